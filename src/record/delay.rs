//! Reserved headers that schedule a record (durable timers) for clients that send record
//! batches, Kafka clients among them: `tidelog.delay.ms` (a delay, decimal ms) or
//! `tidelog.deliver.at.ms` (a time, decimal ms since the epoch).

/// Header: deliver the record this many ms after the broker receives it.
pub const DELAY_HEADER: &str = "tidelog.delay.ms";
/// Header: deliver the record at this time (ms since the epoch).
pub const DELIVER_AT_HEADER: &str = "tidelog.deliver.at.ms";

/// Header of a delivered record: the timestamp it was produced with (decimal ms).
pub const ORIGINAL_TIMESTAMP_HEADER: &str = "tidelog.delay.original.timestamp";
/// Header of a delivered record: its scheduled record id.
pub const TIMER_ID_HEADER: &str = "tidelog.delay.id";

/// Whether `key` is one of the scheduling headers.
pub fn is_delay_header(key: &str) -> bool {
    key == DELAY_HEADER || key == DELIVER_AT_HEADER
}

/// The delay and delivery time a record's headers ask for (the last of each), or why they
/// do not parse.
pub fn delay_of<'a>(
    headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
) -> Result<(Option<i64>, Option<i64>), String> {
    let (mut delay, mut at) = (None, None);
    for (k, v) in headers {
        let slot = match k {
            DELAY_HEADER => &mut delay,
            DELIVER_AT_HEADER => &mut at,
            _ => continue,
        };
        let text = v.and_then(|v| std::str::from_utf8(v).ok()).unwrap_or("");
        *slot =
            Some(text.trim().parse::<i64>().map_err(|_| {
                format!("header '{k}' is {text:?}; it must be a decimal number of ms")
            })?);
    }
    Ok((delay, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_parse_and_bad_ones_say_why() {
        let h = [(DELAY_HEADER, Some(&b"1500"[..])), ("x", None)];
        assert_eq!(delay_of(h), Ok((Some(1500), None)));
        let h = [(DELIVER_AT_HEADER, Some(&b"17"[..]))];
        assert_eq!(delay_of(h), Ok((None, Some(17))));
        let h = [(DELAY_HEADER, Some(&b"soon"[..]))];
        assert!(delay_of(h).unwrap_err().contains("decimal"));
        let h = [(DELAY_HEADER, None)];
        assert!(delay_of(h).is_err());
        assert_eq!(delay_of([]), Ok((None, None)));
    }
}
