//! The message browser (`/topics/<topic>/messages?partition=P&offset=O`): pick a partition
//! and an offset or a time, page through records with key, value (text, JSON or hex),
//! headers and timestamp; and a form that produces a test record.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Form;
use bytes::Bytes;
use maud::{html, Markup};

use super::render::{self, url_part, Clip, Section, View};
use super::{see_other, status_of, Browser, Console, CALL_TIMEOUT};
use crate::client::consumer::{Consumer, ConsumerRecord, StartAt};
use crate::client::error::ClientError;
use crate::client::producer::{Producer, ProducerConfig, ProducerRecord};
use crate::error_code::ErrorCode;
use crate::time_text::{format_rfc3339_ms, parse_rfc3339_ms};

/// Records on a page unless `limit` says otherwise, and the most it may say.
const PAGE_DEFAULT: usize = 20;
const PAGE_MAX: usize = 500;
/// How long a page waits for records before showing what it has.
const READ_WAIT: Duration = Duration::from_secs(2);
/// Record bytes a page reads at most (it shows only the first KiBs of each record).
const PAGE_READ_BYTES: u64 = 8 << 20;
/// One fetch's response size.
const FETCH_BYTES: u32 = 1 << 20;
/// Headers shown per record; the rest are counted.
const HEADERS_SHOWN_MAX: usize = 32;
/// Characters of a header key shown.
const HEADER_KEY_SHOWN_MAX: usize = 256;

/// What the browser shows, from the query string.
#[derive(Debug, Clone, PartialEq)]
struct Position {
    partition: u32,
    /// Start here, or at the first record at or after `time_ms`, or at the log start.
    offset: Option<i64>,
    time_ms: Option<i64>,
    limit: usize,
    view: View,
}

/// Reads the query; a malformed field is an error naming it.
fn position(query: &HashMap<String, String>) -> Result<Position, ClientError> {
    let field = |k: &str| query.get(k).map(|s| s.trim()).filter(|s| !s.is_empty());
    let bad =
        |k: &str, why: &str| ClientError::new(ErrorCode::InvalidRequest, format!("{k}: {why}"));
    let partition = match field("partition") {
        None => 0,
        Some(s) => s
            .parse()
            .map_err(|_| bad("partition", "expected a partition number"))?,
    };
    let offset = match field("offset") {
        None => None,
        Some(s) => Some(
            s.parse::<i64>()
                .ok()
                .filter(|o| *o >= 0)
                .ok_or_else(|| bad("offset", "expected an offset, 0 or more"))?,
        ),
    };
    let time_ms = match field("time") {
        None => None,
        Some(s) => Some(
            parse_rfc3339_ms(s)
                .map_err(|why| bad("time", &why))
                .and_then(|t| {
                    if t < 0 {
                        Err(bad("time", "times before 1970 are not record times"))
                    } else {
                        Ok(t)
                    }
                })?,
        ),
    };
    let limit = match field("limit") {
        None => PAGE_DEFAULT,
        Some(s) => s
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=PAGE_MAX).contains(l))
            .ok_or_else(|| bad("limit", &format!("expected 1 to {PAGE_MAX} records")))?,
    };
    Ok(Position {
        partition,
        offset,
        time_ms,
        limit,
        view: View::parse(field("view")),
    })
}

/// A record as the page shows it: clipped key, value and headers.
struct Shown {
    offset: i64,
    timestamp_ms: i64,
    key: Option<Clip>,
    tag: Option<String>,
    value: Option<Clip>,
    headers: Vec<(String, Option<Clip>)>,
    /// Headers beyond [`HEADERS_SHOWN_MAX`].
    more_headers: usize,
}

impl Shown {
    fn of(r: ConsumerRecord) -> Self {
        let more_headers = r.headers.len().saturating_sub(HEADERS_SHOWN_MAX);
        Self {
            offset: r.offset,
            timestamp_ms: r.timestamp_ms,
            key: r.key.as_deref().map(Clip::new),
            tag: r.tag,
            value: r.value.as_deref().map(Clip::new),
            headers: r
                .headers
                .into_iter()
                .take(HEADERS_SHOWN_MAX)
                .map(|(k, v)| {
                    let key = k.chars().take(HEADER_KEY_SHOWN_MAX).collect();
                    (key, v.as_deref().map(Clip::new))
                })
                .collect(),
            more_headers,
        }
    }
}

/// The bytes a record holds (key, value, headers).
fn record_bytes(r: &ConsumerRecord) -> u64 {
    let len = |b: &Option<Bytes>| b.as_ref().map_or(0, |b| b.len() as u64);
    len(&r.key)
        + len(&r.value)
        + r.headers
            .iter()
            .map(|(k, v)| k.len() as u64 + len(v))
            .sum::<u64>()
}

/// One page of records and the partition's bounds.
struct Page {
    start: i64,
    log_start: i64,
    high_watermark: i64,
    records: Vec<Shown>,
}

async fn read_page(
    console: &Console,
    topic: &str,
    at: &Position,
) -> Result<(u32, Page), ClientError> {
    let (count, offsets) = console.partition_offsets(topic).await?;
    if at.partition >= count {
        return Err(ClientError::new(
            ErrorCode::UnknownTopicOrPartition,
            format!(
                "partition: topic '{topic}' has partitions 0 to {}",
                count.saturating_sub(1)
            ),
        ));
    }
    let bounds = offsets.get(&at.partition).ok_or_else(|| {
        ClientError::new(
            ErrorCode::NotLeaderOrFollower,
            format!("the leader of {topic}-{} did not answer", at.partition),
        )
    })?;
    let (log_start, high_watermark) = (
        bounds.log_start_offset,
        bounds.high_watermark.max(bounds.log_start_offset),
    );
    let mut consumer = Consumer::new(console.data_bootstrap().await?, CALL_TIMEOUT);
    consumer.set_max_bytes(FETCH_BYTES);
    // A time typed into the form wins over the offset the form carries from paging.
    let start = match (at.time_ms, at.offset) {
        (Some(t), _) => {
            let o = consumer.list_offset(topic, at.partition, t).await?;
            if o < 0 {
                high_watermark
            } else {
                o.clamp(log_start, high_watermark)
            }
        }
        (None, Some(o)) => o.clamp(log_start, high_watermark),
        (None, None) => log_start,
    };
    consumer
        .assign(topic, at.partition, StartAt::Offset(start))
        .await?;
    let mut records = Vec::new();
    let mut read = 0u64;
    let deadline = Instant::now() + READ_WAIT;
    while records.len() < at.limit && read < PAGE_READ_BYTES && Instant::now() < deadline {
        let position = consumer
            .positions()
            .values()
            .next()
            .copied()
            .unwrap_or(high_watermark);
        if position >= high_watermark {
            break;
        }
        for r in consumer.poll(Duration::from_millis(200)).await? {
            read += record_bytes(&r);
            if records.len() < at.limit {
                records.push(Shown::of(r));
            }
        }
    }
    Ok((
        count,
        Page {
            start,
            log_start,
            high_watermark,
            records,
        },
    ))
}

/// A link to this browser at another position.
fn link(topic: &str, partition: u32, offset: i64, at: &Position, view: View) -> String {
    format!(
        "/topics/{}/messages?partition={partition}&offset={offset}&limit={}&view={}",
        url_part(topic),
        at.limit,
        view.as_str()
    )
}

/// `GET /topics/{topic}/messages?partition=P&offset=O|time=RFC3339&limit=N&view=text|json|hex`.
pub async fn browse(
    State(console): State<Console>,
    browser: Browser,
    Path(topic): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let title = format!("Messages of {topic}");
    let at = match position(&query) {
        Ok(p) => p,
        Err(e) => {
            return browser.page(
                status_of(&e),
                render::page(Section::Topics, &title, render::error_box(&e)),
            )
        }
    };
    // The form shows where the page starts (a time seek resolved to its offset), so
    // typing another offset next time is not overridden by the time.
    let (status, listing, start) = match read_page(&console, &topic, &at).await {
        Ok((count, page)) => (
            StatusCode::OK,
            records_view(&topic, count, &at, &page),
            Some(page.start),
        ),
        Err(e) => (status_of(&e), html! { (render::error_box(&e)) }, at.offset),
    };
    let body = html! {
        @if query.contains_key("produced") {
            @if let Some(o) = at.offset { (render::notice(&format!("Produced a record at partition {}, offset {o}.", at.partition))) }
        }
        p.actions { a href={"/topics/" (url_part(&topic))} { "← Topic " (topic) } }
        form #seek method="get" action={"/topics/" (url_part(&topic)) "/messages"} {
            label { "Partition" input name="partition" type="number" min="0" value=(at.partition); }
            label { "Offset" input name="offset" type="number" min="0" value=(start.map(|o| o.to_string()).unwrap_or_default()); }
            label { "or time (RFC 3339)" input name="time" placeholder="2026-01-31T12:00:00Z"; }
            label { "Records" input name="limit" type="number" min="1" max=(PAGE_MAX) value=(at.limit); }
            label { "Show values as"
                select name="view" {
                    @for v in [View::Text, View::Json, View::Hex] {
                        option value=(v.as_str()) selected[v == at.view] { (v.as_str()) }
                    }
                }
            }
            button type="submit" { "Go" }
        }
        (listing)
        h2 { "Produce a test record" }
        (produce_form(&browser.token, &topic, &BTreeMap::new()))
    };
    browser.page(status, render::page(Section::Topics, &title, body))
}

fn records_view(topic: &str, partitions: u32, at: &Position, page: &Page) -> Markup {
    let next = page.records.last().map(|r| r.offset + 1);
    let previous =
        (page.start > page.log_start).then(|| (page.start - at.limit as i64).max(page.log_start));
    html! {
        p.meta #bounds {
            "Partition " (at.partition) " of " (partitions) ": log start " (page.log_start)
            ", high watermark " (page.high_watermark) ". Showing from offset " (page.start) "."
        }
        nav.pager {
            @if let Some(p) = previous { a #previous href=(link(topic, at.partition, p, at, at.view)) { "← Previous" } }
            @if let Some(n) = next.filter(|n| *n < page.high_watermark) { a #next href=(link(topic, at.partition, n, at, at.view)) { "Next →" } }
            span.views { "View: "
                @for v in [View::Text, View::Json, View::Hex] {
                    a.current[v == at.view] href=(link(topic, at.partition, page.start, at, v)) { (v.as_str()) } " "
                }
            }
        }
        @if page.records.is_empty() {
            p.meta #no-records { "No records from this position." }
        } @else {
            table #records {
                thead { tr { th.num { "Offset" } th { "Timestamp" } th { "Key" } th { "Tag" } th { "Value" } th { "Headers" } } }
                tbody {
                    @for r in &page.records {
                        tr data-offset=(r.offset) {
                            td.num { (r.offset) }
                            td { time { (format_rfc3339_ms(r.timestamp_ms)) } }
                            td.key { (render::bytes(r.key.as_ref(), at.view)) }
                            td.tag { @if let Some(t) = &r.tag { code { (t) } } }
                            td.value { (render::bytes(r.value.as_ref(), at.view)) }
                            td.headers {
                                @for (k, v) in &r.headers {
                                    div { code { (k) } ": " (render::inline(v.as_ref())) }
                                }
                                @if r.more_headers > 0 { span.note { "+" (r.more_headers) " more headers" } }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn produce_form(token: &str, topic: &str, values: &BTreeMap<String, String>) -> Markup {
    let v = |k: &str| values.get(k).cloned().unwrap_or_default();
    html! {
        form #produce method="post" action={"/topics/" (url_part(topic)) "/messages"} {
            (render::csrf_field(token))
            label { "Partition" input name="partition" type="number" min="0" placeholder="by key" value=(v("partition")); }
            label { "Key" input name="key" placeholder="none" value=(v("key")); }
            label { "Tag" input name="tag" placeholder="none" value=(v("tag")); }
            label.wide { "Value" textarea name="value" rows="3" { (v("value")) } }
            label.wide { "Headers (one key=value per line)" textarea name="headers" rows="2" { (v("headers")) } }
            button type="submit" { "Produce" }
        }
    }
}

/// `POST /topics/{topic}/messages`: partition (optional), key (empty: none), value,
/// headers (`k=v` lines); acks=all, then shows the record in the browser.
pub async fn produce(
    State(console): State<Console>,
    browser: Browser,
    Path(topic): Path<String>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = browser.refusal(&console, &form) {
        return refused;
    }
    let attempt = async {
        super::topics::check_topic_name(&topic)?;
        let record = test_record(&topic, &form)?;
        let config = ProducerConfig {
            acks: -1,
            linger: Duration::ZERO,
            delivery_timeout: CALL_TIMEOUT,
            request_timeout: CALL_TIMEOUT,
            // One record: no retries to deduplicate, and no producer id to allocate.
            enable_idempotence: false,
            ..ProducerConfig::default()
        };
        let producer = Producer::new(console.data_bootstrap().await?, config);
        producer.send_sync(record).await
    };
    match attempt.await {
        Ok(m) => see_other(&format!(
            "/topics/{}/messages?partition={}&offset={}&produced=1",
            url_part(&topic),
            m.partition,
            m.offset,
        )),
        Err(e) => browser.page(
            status_of(&e),
            render::page(
                Section::Topics,
                &format!("Produce to {topic}"),
                html! { (render::error_box(&e)) (produce_form(&browser.token, &topic, &form)) },
            ),
        ),
    }
}

/// The record a produce form describes.
fn test_record(
    topic: &str,
    form: &BTreeMap<String, String>,
) -> Result<ProducerRecord, ClientError> {
    let partition = match form
        .get("partition")
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        None => None,
        Some(s) => Some(s.parse::<u32>().map_err(|_| {
            ClientError::new(
                ErrorCode::InvalidRequest,
                format!("partition: expected a partition number, not '{s}'"),
            )
        })?),
    };
    let key = form
        .get("key")
        .filter(|k| !k.is_empty())
        .map(|k| Bytes::from(k.clone()));
    // Browsers send a textarea's line breaks as CRLF; the record gets what was typed.
    let value = Some(Bytes::from(
        form.get("value")
            .map(|v| v.replace("\r\n", "\n"))
            .unwrap_or_default(),
    ));
    let mut headers = Vec::new();
    for line in form
        .get("headers")
        .map(String::as_str)
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
    {
        let Some((k, v)) = line.split_once('=') else {
            return Err(ClientError::new(
                ErrorCode::InvalidRequest,
                format!("headers: line '{line}' is not key=value"),
            ));
        };
        headers.push((k.trim().to_owned(), Some(Bytes::from(v.trim().to_owned()))));
    }
    Ok(ProducerRecord {
        topic: topic.to_owned(),
        partition,
        key,
        value,
        headers,
        tag: form
            .get("tag")
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .map(str::to_owned),
        timestamp_ms: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn positions_come_from_the_query_and_bad_fields_are_named() {
        let p = position(&query(&[])).unwrap();
        assert_eq!(
            (p.partition, p.offset, p.limit, p.view),
            (0, None, PAGE_DEFAULT, View::Text)
        );
        let p = position(&query(&[
            ("partition", "2"),
            ("offset", "7"),
            ("view", "hex"),
            ("limit", "5"),
        ]))
        .unwrap();
        assert_eq!(
            (p.partition, p.offset, p.limit, p.view),
            (2, Some(7), 5, View::Hex)
        );
        let p = position(&query(&[("time", "2026-01-31T12:00:00Z")])).unwrap();
        assert_eq!(p.time_ms, Some(1_769_860_800_000));
        for (k, v) in [
            ("partition", "-1"),
            ("offset", "-5"),
            ("limit", "0"),
            ("limit", "100000"),
            ("time", "yesterday"),
        ] {
            let e = position(&query(&[(k, v)])).unwrap_err();
            assert!(e.message.starts_with(k), "{k}={v}: {}", e.message);
        }
    }

    #[test]
    fn test_records_carry_key_value_and_headers() {
        let form: BTreeMap<String, String> = [
            ("key", "k"),
            ("value", "<v>"),
            ("headers", "a=1\n\nb = 2"),
            ("partition", ""),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let r = test_record("t", &form).unwrap();
        assert_eq!(r.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(r.value.as_deref(), Some(&b"<v>"[..]));
        assert_eq!(r.headers.len(), 2);
        assert_eq!(r.partition, None);
        let mut bad = form.clone();
        bad.insert("headers".into(), "nokey".into());
        assert!(test_record("t", &bad).is_err());
        bad.insert("headers".into(), String::new());
        bad.insert("partition".into(), "x".into());
        assert!(test_record("t", &bad)
            .unwrap_err()
            .message
            .starts_with("partition"));
    }
}
