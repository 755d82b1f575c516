//! The console's page frame and how it shows things: record bytes as text, JSON or hex,
//! times, sizes, and URL pieces. Everything goes through maud, which escapes every
//! interpolated string, so names and record contents never become markup.

use maud::{html, Markup, DOCTYPE};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::client::error::ClientError;

/// Bytes of a key, value or header shown before "truncated".
pub const SHOWN_BYTES_MAX: usize = 4096;

/// Characters left as they are in a path segment or query value.
const URL_SAFE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `text` percent-encoded for a URL path segment or query value.
pub fn url_part(text: &str) -> String {
    utf8_percent_encode(text, URL_SAFE).to_string()
}

/// The section a page belongs to (highlighted in the navigation bar).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// Cluster overview.
    Overview,
    /// Topics and messages.
    Topics,
    /// Consumer groups.
    Groups,
}

/// A whole page: navigation, a title and `body`.
pub fn page(section: Section, title: &str, body: Markup) -> Markup {
    let nav = [
        (Section::Overview, "/", "Overview"),
        (Section::Topics, "/topics", "Topics"),
        (Section::Groups, "/groups", "Consumer groups"),
    ];
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · tidelog" }
                link rel="stylesheet" href="/static/console.css";
                script src="/static/console.js" defer {}
            }
            body {
                header {
                    a.brand href="/" { "tidelog" }
                    nav {
                        @for (s, href, label) in nav {
                            a.current[s == section] href=(href) { (label) }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A failed call shown as a box with its error code (and whether retrying may help).
pub fn error_box(error: &ClientError) -> Markup {
    html! {
        div.error role="alert" {
            strong { (error.code.as_str()) } ": " (error.message)
            @if error.is_retriable() { " (temporary: reload to retry)" }
        }
    }
}

/// A notice (e.g. after a successful action).
pub fn notice(text: &str) -> Markup {
    html! { div.notice role="status" { (text) } }
}

/// The hidden CSRF field every form carries.
pub fn csrf_field(token: &str) -> Markup {
    html! { input type="hidden" name=(super::csrf::FIELD) value=(token); }
}

/// How record bytes are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum View {
    /// UTF-8 text (hex when the bytes are not UTF-8).
    #[default]
    Text,
    /// Pretty-printed JSON (text when the bytes are not JSON).
    Json,
    /// A hex dump.
    Hex,
}

impl View {
    /// From a query value (`text`, `json`, `hex`); anything else is text.
    pub fn parse(text: Option<&str>) -> Self {
        match text {
            Some("json") => View::Json,
            Some("hex") => View::Hex,
            _ => View::Text,
        }
    }

    /// The query value.
    pub fn as_str(self) -> &'static str {
        match self {
            View::Text => "text",
            View::Json => "json",
            View::Hex => "hex",
        }
    }
}

/// Record bytes as `view` shows them; `None` is a null key or value.
pub fn bytes(data: Option<&[u8]>, view: View) -> Markup {
    let Some(data) = data else {
        return html! { span.null { "null" } };
    };
    let (shown, cut) = if data.len() > SHOWN_BYTES_MAX {
        (&data[..SHOWN_BYTES_MAX], true)
    } else {
        (data, false)
    };
    let body = match (view, std::str::from_utf8(data)) {
        (View::Hex, _) => html! { pre.hex { (hex_dump(shown)) } },
        (View::Json, Ok(_)) if !cut => match serde_json::from_slice::<serde_json::Value>(data) {
            Ok(v) => html! {
                pre.json { (serde_json::to_string_pretty(&v).unwrap_or_default()) }
            },
            Err(_) => html! { pre { (text_prefix(shown)) } span.note { "(not JSON)" } },
        },
        (_, Ok(_)) => html! { pre { (text_prefix(shown)) } },
        // The prefix of valid UTF-8 cut mid-character is still shown as text.
        (_, Err(e)) if cut && e.error_len().is_none() => html! { pre { (text_prefix(shown)) } },
        (_, Err(_)) => html! { pre.hex { (hex_dump(shown)) } span.note { "(binary)" } },
    };
    html! {
        (body)
        @if cut {
            span.note { "(" (data.len()) " bytes; the first " (SHOWN_BYTES_MAX) " shown)" }
        }
    }
}

/// Short bytes (a header value) inline: text, or hex when not UTF-8, cut at
/// [`SHOWN_BYTES_MAX`].
pub fn inline(data: Option<&[u8]>) -> Markup {
    let Some(data) = data else {
        return html! { span.null { "null" } };
    };
    let shown = &data[..data.len().min(SHOWN_BYTES_MAX)];
    let cut = shown.len() < data.len();
    html! {
        @match std::str::from_utf8(shown) {
            Ok(text) => span { (text) },
            Err(_) => span.hex { "0x" (shown.iter().map(|b| format!("{b:02x}")).collect::<String>()) },
        }
        @if cut { span.note { " (" (data.len()) " bytes)" } }
    }
}

/// The longest valid UTF-8 prefix of `data` as text.
fn text_prefix(data: &[u8]) -> &str {
    match std::str::from_utf8(data) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(&data[..e.valid_up_to()]).unwrap_or_default(),
    }
}

/// A classic hex dump: offset, 16 bytes in hex, and their printable ASCII.
pub fn hex_dump(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len() * 4 + 16);
    for (i, line) in data.chunks(16).enumerate() {
        out.push_str(&format!("{:08x}  ", i * 16));
        for j in 0..16 {
            match line.get(j) {
                Some(b) => out.push_str(&format!("{b:02x} ")),
                None => out.push_str("   "),
            }
        }
        out.push(' ');
        out.extend(line.iter().map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        }));
        out.push('\n');
    }
    out
}

/// A byte count for people (1023 B, 1.5 KiB, 2.0 GiB).
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A list of broker ids: `1, 2, 3` (a dash when empty).
pub fn ids(list: &[i32]) -> String {
    if list.is_empty() {
        return "–".to_owned();
    }
    list.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn markup_in_record_bytes_is_shown_as_text() {
        let evil = b"<script>alert(1)</script>";
        for view in [View::Text, View::Json, View::Hex] {
            let html = bytes(Some(evil), view).into_string();
            assert!(!html.contains("<script"), "{view:?}: {html}");
        }
        let html = bytes(Some(evil), View::Text).into_string();
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{html}"
        );
        let json = bytes(Some(br#"{"a":"<b>"}"#), View::Json).into_string();
        assert!(
            json.contains("&lt;b&gt;") && !json.contains("<b>"),
            "{json}"
        );
    }

    #[test]
    fn views_show_null_json_binary_and_long_values() {
        assert!(bytes(None, View::Text).into_string().contains("null"));
        let json = bytes(Some(br#"{"a":1}"#), View::Json).into_string();
        assert!(json.contains("&quot;a&quot;: 1"), "{json}");
        let binary = bytes(Some(&[0xff, 0x00, 0x41]), View::Text).into_string();
        assert!(
            binary.contains("ff 00 41") && binary.contains("(binary)"),
            "{binary}"
        );
        let long = vec![b'x'; SHOWN_BYTES_MAX + 10];
        let shown = bytes(Some(&long), View::Text).into_string();
        assert!(
            shown.contains(&format!("{} bytes", SHOWN_BYTES_MAX + 10)),
            "{shown}"
        );
        assert!(!shown.contains(&"x".repeat(SHOWN_BYTES_MAX + 1)));
    }

    #[test]
    fn hex_dumps_and_sizes() {
        assert_eq!(
            hex_dump(b"AB\n"),
            format!("00000000  41 42 0a {} AB.\n", "   ".repeat(13))
        );
        assert_eq!(size(1023), "1023 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(3 << 30), "3.0 GiB");
        assert_eq!(ids(&[]), "–");
        assert_eq!(ids(&[1, 2]), "1, 2");
    }

    #[test]
    fn url_parts_are_encoded() {
        assert_eq!(url_part("a b/c?d&e=f#"), "a%20b%2Fc%3Fd%26e%3Df%23");
        assert_eq!(url_part("topic-1.x_y~"), "topic-1.x_y~");
    }

    proptest! {
        #[test]
        fn no_bytes_become_markup(data in proptest::collection::vec(any::<u8>(), 0..600), view in 0..3u8) {
            let view = [View::Text, View::Json, View::Hex][view as usize];
            let html = bytes(Some(&data), view).into_string();
            // Only the tags the renderer itself writes appear.
            let stripped = html
                .replace("<pre>", "").replace("</pre>", "")
                .replace("<pre class=\"hex\">", "").replace("<pre class=\"json\">", "")
                .replace("<span class=\"note\">", "").replace("</span>", "");
            prop_assert!(!stripped.contains('<'), "{}", html);
        }
    }
}
