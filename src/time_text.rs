//! Times as text: RFC 3339 date-times (`--to-datetime`, the console's timestamp field and
//! its record times) and durations (`--by-duration`), written here to keep the dependency
//! list short. The parsers double as clap value parsers, so a malformed flag is a usage
//! error (exit 2).

/// Milliseconds since the Unix epoch of an RFC 3339 date-time:
/// `2026-01-31T12:00:00Z`, `2026-01-31T12:00:00.250+02:00` (a space may stand for `T`).
pub fn parse_rfc3339_ms(text: &str) -> Result<i64, String> {
    let bad = |why: &str| {
        format!("'{text}' is not an RFC 3339 date-time ({why}), e.g. 2026-01-31T12:00:00Z")
    };
    let b = text.trim().as_bytes();
    if b.len() < 20 {
        return Err(bad("too short"));
    }
    let num = |range: std::ops::Range<usize>| -> Result<i64, String> {
        let s = std::str::from_utf8(&b[range]).map_err(|_| bad("not ASCII"))?;
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad("expected digits"));
        }
        s.parse::<i64>().map_err(|_| bad("expected digits"))
    };
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') || b[13] != b':' {
        return Err(bad("expected YYYY-MM-DDTHH:MM:SS"));
    }
    if b[16] != b':' {
        return Err(bad("expected YYYY-MM-DDTHH:MM:SS"));
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err(bad("a field is out of range"));
    }
    let mut i = 19;
    let mut millis = 0i64;
    if b[i] == b'.' {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return Err(bad("no digits after '.'"));
        }
        // The first three digits are milliseconds; finer digits are dropped.
        let digits = &text.trim()[start..i];
        let ms = format!("{:0<3}", &digits[..digits.len().min(3)]);
        millis = ms.parse::<i64>().map_err(|_| bad("bad fraction"))?;
    }
    let offset_minutes = match b.get(i) {
        Some(b'Z' | b'z') if i + 1 == b.len() => 0,
        Some(sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
            let (h, m) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if h > 23 || m > 59 {
                return Err(bad("offset out of range"));
            }
            let minutes = h * 60 + m;
            if *sign == b'+' {
                minutes
            } else {
                -minutes
            }
        }
        _ => return Err(bad("expected Z or an offset like +02:00 at the end")),
    };
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset_minutes * 60;
    Ok(seconds * 1000 + millis)
}

/// Milliseconds of a duration: ISO 8601 (`PT1H`, `P1DT2H30M`, `PT0.5S`) or a compact form
/// (`1h`, `1h30m`, `90s`, `500ms`, `2d`).
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let bad =
        || format!("'{text}' is not a duration: use e.g. PT1H, P1DT2H, 1h, 30m, 90s or 500ms");
    let t = text.trim();
    let (iso, body) = match t.strip_prefix(['P', 'p']) {
        Some(rest) => (true, rest),
        None => (false, t),
    };
    let mut total = 0f64;
    let mut in_time = !iso;
    let mut number = String::new();
    let mut chars = body.chars().peekable();
    let mut any = false;
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() || c == '.' {
            number.push(c);
            continue;
        }
        if iso && (c == 'T' || c == 't') {
            if in_time || !number.is_empty() {
                return Err(bad());
            }
            in_time = true;
            continue;
        }
        let value: f64 = number.parse().map_err(|_| bad())?;
        number.clear();
        let unit_ms = match (c.to_ascii_lowercase(), in_time) {
            ('d', false) if iso => 86_400_000.0,
            ('w', false) if iso => 7.0 * 86_400_000.0,
            ('d', true) if !iso => 86_400_000.0,
            ('h', true) => 3_600_000.0,
            ('m', true) if !iso && chars.peek().is_some_and(|n| *n == 's' || *n == 'S') => {
                chars.next();
                1.0
            }
            ('m', true) => 60_000.0,
            ('s', true) => 1000.0,
            _ => return Err(bad()),
        };
        total += value * unit_ms;
        any = true;
    }
    if !number.is_empty() || !any || !total.is_finite() {
        return Err(bad());
    }
    Ok(total.round() as u64)
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A Unix time in milliseconds as an RFC 3339 date-time in UTC with milliseconds,
/// e.g. `2026-01-31T12:00:00.250Z`.
pub fn format_rfc3339_ms(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (the inverse of
/// [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatting_round_trips_through_parsing() {
        assert_eq!(format_rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
        for ms in [
            0,
            951_782_400_123,
            1_764_670_000_000,
            4_107_542_399_999,
            -86_400_000,
        ] {
            assert_eq!(parse_rfc3339_ms(&format_rfc3339_ms(ms)), Ok(ms), "{ms}");
        }
    }

    #[test]
    fn rfc3339_date_times() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(
            parse_rfc3339_ms("2024-02-29T12:34:56.789Z"),
            Ok(1_709_210_096_789)
        );
        assert_eq!(
            parse_rfc3339_ms("2024-02-29T14:34:56.789+02:00"),
            Ok(1_709_210_096_789)
        );
        assert_eq!(
            parse_rfc3339_ms("2024-02-29 12:34:56.7Z"),
            Ok(1_709_210_096_700)
        );
        assert_eq!(parse_rfc3339_ms("1969-12-31T23:59:59Z"), Ok(-1000));
        for bad in [
            "2023-02-29T00:00:00Z",
            "2024-13-01T00:00:00Z",
            "2024-01-01T00:00:00",
            "2024-01-01",
            "yesterday",
            "2024-01-01T00:00:00+0200",
        ] {
            assert!(parse_rfc3339_ms(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_iso_and_compact() {
        assert_eq!(parse_duration_ms("PT1H"), Ok(3_600_000));
        assert_eq!(parse_duration_ms("P1DT2H30M"), Ok(95_400_000));
        assert_eq!(parse_duration_ms("PT0.5S"), Ok(500));
        assert_eq!(parse_duration_ms("pt15m"), Ok(900_000));
        assert_eq!(parse_duration_ms("1h"), Ok(3_600_000));
        assert_eq!(parse_duration_ms("1h30m"), Ok(5_400_000));
        assert_eq!(parse_duration_ms("90s"), Ok(90_000));
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("2d"), Ok(172_800_000));
        for bad in ["", "P", "PT", "1", "1x", "PT1D", "P1H", "h"] {
            assert!(parse_duration_ms(bad).is_err(), "{bad}");
        }
    }
}
