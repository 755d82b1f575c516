//! The web console at `/` on the HTTP port: server-rendered pages over the cluster, built
//! as a client of it. Every page talks to the cluster through the Rust client library at
//! this process's own client listener, so the console sees and is refused exactly what
//! any client would be, and works on every role (a controller's console reaches brokers
//! through the cluster's metadata).
//!
//! - [`cluster`]: the overview (controllers, brokers, partition health);
//! - [`topics`]: list, search, create, delete, and a topic's partitions and configs;
//! - [`messages`]: the message browser and the test-record form;
//! - [`groups`]: groups, members, lag, and resetting an empty group's offsets.
//!
//! Safety: maud escapes every interpolated string; a Content-Security-Policy allows only
//! the console's own script and style (so even an escaping bug could not run a record as
//! script); every mutating action is a POST carrying a CSRF token ([`csrf`]) from the
//! same origin; pages are answered only under IP addresses, `localhost` and configured
//! host names (no DNS rebinding); pages run under a deadline, a few at a time, and hold
//! at most a few KiB of each record.

mod cluster;
pub mod csrf;
mod groups;
mod messages;
pub mod render;
mod topics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
use maud::{html, Markup};

use crate::api::proto::PartitionOffsets;
use crate::client::admin::AdminClient;
use crate::client::error::ClientError;
use csrf::CsrfKey;

/// How long one call of a page to the cluster may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a whole page may take.
const PAGE_DEADLINE: Duration = Duration::from_secs(15);
/// Console requests served at once; more are answered 503.
const PAGES_AT_ONCE: usize = 8;
/// How long a form's body may take to arrive, and how large it may be.
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(5);
const FORM_BYTES_MAX: usize = 2 << 20;

const STYLE: &str = include_str!("static/console.css");
const SCRIPT: &str = include_str!("static/console.js");

/// Only the console's own files; no inline script, no framing, forms post only here.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

/// What the console's handlers share.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    /// This process's client listener, if it serves one.
    client_address: Option<String>,
    /// Whether this process is a broker (else brokers are found through the cluster).
    broker: bool,
    key: CsrfKey,
    /// Host names answered besides IP literals and `localhost` (lower case).
    allowed_hosts: Vec<String>,
    slots: Arc<tokio::sync::Semaphore>,
}

impl Console {
    /// A console reaching the cluster at `client_address` (this process's client
    /// listener; an unspecified host is reached on loopback), answering pages under IP
    /// addresses, `localhost` and `allowed_hosts`.
    pub fn new(client_address: Option<SocketAddr>, broker: bool, allowed_hosts: &[String]) -> Self {
        let client_address = client_address.map(|mut a| {
            if a.ip().is_unspecified() {
                a.set_ip(match a {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            a.to_string()
        });
        Self {
            inner: Arc::new(Inner {
                client_address,
                broker,
                key: CsrfKey::random(),
                allowed_hosts: allowed_hosts
                    .iter()
                    .map(|h| h.to_ascii_lowercase())
                    .collect(),
                slots: Arc::new(tokio::sync::Semaphore::new(PAGES_AT_ONCE)),
            }),
        }
    }

    /// Where admin calls go (any node serves them).
    fn admin_bootstrap(&self) -> Result<Vec<String>, ClientError> {
        self.inner
            .client_address
            .clone()
            .map(|a| vec![a])
            .ok_or_else(|| {
                ClientError::new(
                    crate::error_code::ErrorCode::InvalidRequest,
                    "this process serves no client listener for the console to use",
                )
            })
    }

    /// An admin client.
    fn admin(&self) -> Result<AdminClient, ClientError> {
        Ok(AdminClient::new(self.admin_bootstrap()?, CALL_TIMEOUT))
    }

    /// The partition count of `topic` and each partition's offsets and size (from the
    /// leaders that answered). Asked through Admin, which never creates a topic, so a
    /// page about a missing topic does not create it on a cluster that auto-creates.
    async fn partition_offsets(
        &self,
        topic: &str,
    ) -> Result<(u32, std::collections::BTreeMap<u32, PartitionOffsets>), ClientError> {
        topics::check_topic_name(topic)?;
        let described = self
            .admin()?
            .describe_topics_with_offsets(vec![topic.to_owned()])
            .await?;
        let d = described
            .into_iter()
            .find(|d| d.topic.as_ref().is_some_and(|t| t.name == topic))
            .ok_or_else(|| {
                ClientError::new(
                    crate::error_code::ErrorCode::UnknownTopicOrPartition,
                    format!("there is no topic '{topic}'"),
                )
            })?;
        let count = d.topic.as_ref().map_or(0, |t| t.partitions.len() as u32);
        Ok((
            count,
            d.offsets.into_iter().map(|o| (o.partition, o)).collect(),
        ))
    }

    /// Where produce, fetch and group calls go: this broker, or the cluster's live
    /// brokers when this process is only a controller.
    async fn data_bootstrap(&self) -> Result<Vec<String>, ClientError> {
        let own = self.admin_bootstrap()?;
        if self.inner.broker {
            return Ok(own);
        }
        let cluster = self.admin()?.describe_cluster().await?;
        let brokers: Vec<String> = cluster
            .brokers
            .iter()
            .filter_map(|b| b.broker.as_ref())
            .filter(|b| b.state == "unfenced")
            .map(|b| b.address.clone())
            .collect();
        if brokers.is_empty() {
            return Err(ClientError::new(
                crate::error_code::ErrorCode::ClusterNotReady,
                "no broker is registered and unfenced",
            ));
        }
        Ok(brokers)
    }
}

/// The console's routes.
pub fn router(console: Console) -> Router {
    Router::new()
        .route("/", get(cluster::overview))
        .route("/topics", get(topics::list).post(topics::create))
        .route("/topics/{topic}", get(topics::show))
        .route(
            "/topics/{topic}/delete",
            get(topics::confirm_delete).post(topics::delete),
        )
        .route(
            "/topics/{topic}/messages",
            get(messages::browse).post(messages::produce),
        )
        .route("/groups", get(groups::list))
        .route("/group", get(groups::show))
        .route("/group/reset-offsets", axum::routing::post(groups::reset))
        .route(
            "/static/console.css",
            get(|| async { static_file("text/css", STYLE) }),
        )
        .route(
            "/static/console.js",
            get(|| async { static_file("text/javascript", SCRIPT) }),
        )
        .layer(axum::middleware::from_fn_with_state(console.clone(), guard))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(console)
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        body,
    )
        .into_response()
}

/// Refuses requests under foreign host names (DNS rebinding) and cross-origin POSTs,
/// and runs the page under [`PAGE_DEADLINE`], at most [`PAGES_AT_ONCE`] at a time.
async fn guard(State(console): State<Console>, request: Request, next: Next) -> Response {
    let headers = request.headers();
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let host = text(header::HOST).unwrap_or_default();
    if !host_allowed(host, &console.inner.allowed_hosts) {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "the console answers under IP addresses, localhost and the names in \
                 http_allowed_hosts, not under '{host}'\n"
            ),
        )
            .into_response();
    }
    if request.method() == Method::POST
        && !same_origin(
            text(header::ORIGIN),
            text(header::HeaderName::from_static("sec-fetch-site")),
            host,
        )
    {
        return (
            StatusCode::FORBIDDEN,
            "a form posted from another site is refused; nothing was changed\n",
        )
            .into_response();
    }
    if request.uri().path().starts_with("/static/") {
        // Built-in files cost nothing to serve: never turned away.
        return next.run(request).await;
    }
    // A form body is read before the page takes a slot, and must arrive in time, so a
    // client trickling bodies cannot hold the console's slots.
    let request = if request.method() == Method::POST {
        let (parts, body) = request.into_parts();
        match tokio::time::timeout(
            BODY_READ_TIMEOUT,
            axum::body::to_bytes(body, FORM_BYTES_MAX),
        )
        .await
        {
            Ok(Ok(bytes)) => Request::from_parts(parts, axum::body::Body::from(bytes)),
            Ok(Err(_)) => {
                let declared = parts
                    .headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<usize>().ok());
                return if declared.is_some_and(|n| n > FORM_BYTES_MAX) {
                    (
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("a console form holds at most {FORM_BYTES_MAX} bytes\n"),
                    )
                        .into_response()
                } else {
                    (StatusCode::BAD_REQUEST, "the form could not be read\n").into_response()
                };
            }
            Err(_) => {
                return (
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the form did not arrive within {} s\n",
                        BODY_READ_TIMEOUT.as_secs()
                    ),
                )
                    .into_response()
            }
        }
    } else {
        request
    };
    let Ok(_slot) = console.inner.slots.clone().try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            "the console is busy with other pages; retry in a moment\n",
        )
            .into_response();
    };
    match tokio::time::timeout(PAGE_DEADLINE, next.run(request)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "the cluster did not answer within {} s; reload to retry\n",
                PAGE_DEADLINE.as_secs()
            ),
        )
            .into_response(),
    }
}

/// Whether a `Host` header names this console: an IP literal (which no rebinding
/// attacker's page can send), `localhost`, or one of `allowed` (lower case), with any port.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    if let Some(rest) = host.strip_prefix('[') {
        return rest
            .split_once(']')
            .is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok());
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    if name.is_empty() {
        return false;
    }
    let name = name.to_ascii_lowercase();
    name.parse::<std::net::Ipv4Addr>().is_ok() || name == "localhost" || allowed.contains(&name)
}

/// Whether a POST comes from the console's own pages: its `Origin` (when sent) is this
/// host's, else `Sec-Fetch-Site` (when sent) says same-origin or a user's own action.
fn same_origin(origin: Option<&str>, fetch_site: Option<&str>, host: &str) -> bool {
    match origin {
        Some(o) => o == format!("http://{host}") || o == format!("https://{host}"),
        None => fetch_site.is_none_or(|s| s == "same-origin" || s == "none"),
    }
}

async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// The browser a request comes from: its id (from the console cookie, or new) and the
/// CSRF token its forms carry.
pub struct Browser {
    id: String,
    fresh: bool,
    token: String,
}

impl FromRequestParts<Console> for Browser {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Console,
    ) -> Result<Self, Self::Rejection> {
        let existing = parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(csrf::browser_id_from_cookies)
            .map(str::to_owned);
        let (id, fresh) = match existing {
            Some(id) => (id, false),
            None => (csrf::new_browser_id(), true),
        };
        let token = console.inner.key.token(&id);
        Ok(Browser { id, fresh, token })
    }
}

impl Browser {
    /// A page, giving a new browser its cookie.
    fn page(&self, status: StatusCode, markup: Markup) -> Response {
        let mut response = (status, markup).into_response();
        if self.fresh {
            if let Ok(v) = HeaderValue::from_str(&csrf::set_cookie(&self.id)) {
                response.headers_mut().insert(header::SET_COOKIE, v);
            }
        }
        response
            .headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        response
    }

    /// The 403 page for a form whose token does not belong to this browser (a fresh
    /// browser has sent none); `None` when the token is good.
    fn refusal(
        &self,
        console: &Console,
        form: &std::collections::BTreeMap<String, String>,
    ) -> Option<Response> {
        match form.get(csrf::FIELD).map(String::as_str) {
            Some(t) if !self.fresh && console.inner.key.verify(&self.id, t) => None,
            _ => Some(self.page(
                StatusCode::FORBIDDEN,
                render::page(
                    render::Section::Overview,
                    "Form refused",
                    html! {
                        div.error role="alert" {
                            "This form was not sent from this console page in this browser "
                            "session (a missing or stale CSRF token). Nothing was changed. "
                            "Go back, reload the page and send it again."
                        }
                    },
                ),
            )),
        }
    }
}

/// Where a successful POST sends the browser (Post/Redirect/Get).
fn see_other(location: &str) -> Response {
    Redirect::to(location).into_response()
}

/// A failed call as a page status: the client's mistakes 4xx, the cluster's 5xx.
fn status_of(error: &ClientError) -> StatusCode {
    use crate::error_code::ErrorCode as C;
    match error.code {
        C::UnknownTopicOrPartition | C::GroupIdNotFound => StatusCode::NOT_FOUND,
        C::TopicAlreadyExists | C::GroupNotEmpty => StatusCode::CONFLICT,
        C::UnknownServerError | C::CorruptMessage => StatusCode::INTERNAL_SERVER_ERROR,
        _ if error.is_retriable() => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ip_literals_localhost_and_configured_names_are_answered() {
        let allowed = vec!["console.example.com".to_owned()];
        for ok in [
            "127.0.0.1:9644",
            "10.1.2.3",
            "[::1]:9644",
            "[fe80::1]",
            "localhost:9644",
            "LOCALHOST",
            "console.example.com:80",
            "Console.Example.com",
        ] {
            assert!(host_allowed(ok, &allowed), "{ok}");
        }
        for refused in [
            "",
            ":9644",
            "evil.example:9644",
            "127.0.0.1.evil.example",
            "[not-an-ip]:1",
            "localhost.evil.example",
            "console.example.com.evil",
            "example.com",
        ] {
            assert!(!host_allowed(refused, &allowed), "{refused}");
        }
    }

    #[test]
    fn posts_must_come_from_the_same_origin() {
        let host = "127.0.0.1:9644";
        assert!(same_origin(Some("http://127.0.0.1:9644"), None, host));
        assert!(same_origin(
            Some("https://127.0.0.1:9644"),
            Some("same-origin"),
            host
        ));
        assert!(!same_origin(
            Some("http://evil.example"),
            Some("cross-site"),
            host
        ));
        assert!(!same_origin(Some("null"), None, host));
        assert!(same_origin(None, None, host));
        assert!(same_origin(None, Some("none"), host));
        assert!(!same_origin(None, Some("cross-site"), host));
        assert!(!same_origin(None, Some("same-site"), host));
    }
}
