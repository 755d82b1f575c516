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

/// `text` percent-encoded for a URL path segment or query value (`.` and `..`, which
/// a browser would resolve as path steps, encoded too).
pub fn url_part(text: &str) -> String {
    match text {
        "." => "%2E".to_owned(),
        ".." => "%2E%2E".to_owned(),
        _ => utf8_percent_encode(text, URL_SAFE).to_string(),
    }
}

/// The first [`SHOWN_BYTES_MAX`] bytes of a key, value or header (copied, so the fetched
/// batch is not kept alive) and the full length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clip {
    /// The bytes shown.
    pub head: Vec<u8>,
    /// The full length.
    pub len: usize,
}

impl Clip {
    /// Clips `data`.
    pub fn new(data: &[u8]) -> Self {
        Self {
            head: data[..data.len().min(SHOWN_BYTES_MAX)].to_vec(),
            len: data.len(),
        }
    }

    fn is_cut(&self) -> bool {
        self.head.len() < self.len
    }
}

/// Pretty-printed JSON longer than this is shown as plain text instead (deep nesting
/// multiplies indentation).
const PRETTY_JSON_MAX: usize = 16 * SHOWN_BYTES_MAX;

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
            @if error.is_retriable() && error.code != crate::error_code::ErrorCode::UnknownTopicOrPartition {
                " (temporary: reload to retry)"
            }
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
pub fn bytes(data: Option<&Clip>, view: View) -> Markup {
    let Some(clip) = data else {
        return html! { span.null { "null" } };
    };
    let shown = clip.head.as_slice();
    let cut = clip.is_cut();
    let text = utf8_text(shown, cut);
    let pretty = match (view, text, cut) {
        (View::Json, Some(_), false) => serde_json::from_slice::<serde_json::Value>(shown)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok()),
        _ => None,
    };
    let body = match (view, text, pretty) {
        (View::Hex, _, _) => html! { pre.hex { (hex_dump(shown)) } },
        (View::Json, Some(_), Some(p)) if p.len() <= PRETTY_JSON_MAX => html! { pre.json { (p) } },
        (View::Json, Some(t), Some(_)) => {
            html! { pre { (t) } span.note { "(JSON too deep to indent)" } }
        }
        (View::Json, Some(t), None) if !cut => html! { pre { (t) } span.note { "(not JSON)" } },
        (_, Some(t), _) => html! { pre { (t) } },
        (_, None, _) => html! { pre.hex { (hex_dump(shown)) } span.note { "(binary)" } },
    };
    html! {
        (body)
        @if cut {
            span.note { "(" (clip.len) " bytes; the first " (SHOWN_BYTES_MAX) " shown)" }
        }
    }
}

/// `data` as text when it is UTF-8; when `cut`, a character split at the end is dropped.
fn utf8_text(data: &[u8], cut: bool) -> Option<&str> {
    match std::str::from_utf8(data) {
        Ok(s) => Some(s),
        Err(e) if cut && e.error_len().is_none() => {
            std::str::from_utf8(&data[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    }
}

/// Short bytes (a header value) inline: text, or hex when not UTF-8.
pub fn inline(data: Option<&Clip>) -> Markup {
    let Some(clip) = data else {
        return html! { span.null { "null" } };
    };
    html! {
        @match utf8_text(&clip.head, clip.is_cut()) {
            Some(text) => span { (text) },
            None => span.hex { "0x" (clip.head.iter().map(|b| format!("{b:02x}")).collect::<String>()) },
        }
        @if clip.is_cut() { span.note { " (" (clip.len) " bytes)" } }
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
            let html = bytes(Some(&Clip::new(evil)), view).into_string();
            assert!(!html.contains("<script"), "{view:?}: {html}");
        }
        let html = bytes(Some(&Clip::new(evil)), View::Text).into_string();
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{html}"
        );
        let json = bytes(Some(&Clip::new(br#"{"a":"<b>"}"#)), View::Json).into_string();
        assert!(
            json.contains("&lt;b&gt;") && !json.contains("<b>"),
            "{json}"
        );
    }

    #[test]
    fn views_show_null_json_binary_and_long_values() {
        assert!(bytes(None, View::Text).into_string().contains("null"));
        let json = bytes(Some(&Clip::new(br#"{"a":1}"#)), View::Json).into_string();
        assert!(json.contains("&quot;a&quot;: 1"), "{json}");
        let binary = bytes(Some(&Clip::new(&[0xff, 0x00, 0x41])), View::Text).into_string();
        assert!(
            binary.contains("ff 00 41") && binary.contains("(binary)"),
            "{binary}"
        );
        let long = vec![b'x'; SHOWN_BYTES_MAX + 10];
        let shown = bytes(Some(&Clip::new(&long)), View::Text).into_string();
        assert!(
            shown.contains(&format!("{} bytes", SHOWN_BYTES_MAX + 10)),
            "{shown}"
        );
        assert!(!shown.contains(&"x".repeat(SHOWN_BYTES_MAX + 1)));
        // Text cut inside a character stays text; a deep JSON value is not indented.
        let mut euro = vec![b'a'; SHOWN_BYTES_MAX - 1];
        euro.extend("€€".as_bytes());
        assert!(!bytes(Some(&Clip::new(&euro)), View::Text)
            .into_string()
            .contains("(binary)"));
        let deep = format!("{}{}", "[".repeat(120), "]".repeat(120));
        let html = bytes(Some(&Clip::new(deep.as_bytes())), View::Json).into_string();
        assert!(html.len() < PRETTY_JSON_MAX, "{}", html.len());
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
        assert_eq!(url_part(".."), "%2E%2E");
        assert_eq!(url_part("."), "%2E");
    }

    proptest! {
        #[test]
        fn no_bytes_become_markup(data in proptest::collection::vec(any::<u8>(), 0..600), view in 0..3u8) {
            let view = [View::Text, View::Json, View::Hex][view as usize];
            let html = bytes(Some(&Clip::new(&data)), view).into_string();
            // Only the tags the renderer itself writes appear.
            let stripped = html
                .replace("<pre>", "").replace("</pre>", "")
                .replace("<pre class=\"hex\">", "").replace("<pre class=\"json\">", "")
                .replace("<span class=\"note\">", "").replace("</span>", "");
            prop_assert!(!stripped.contains('<'), "{}", html);
        }
    }
}
