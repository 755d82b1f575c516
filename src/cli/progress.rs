//! Progress of long CLI work (perf runs, waiting for a reassignment, planning an offset
//! reset over many partitions): one line on stderr, redrawn in place at most a few times
//! a second, and only when stderr is a terminal, so piped output and scripts see nothing
//! of it.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How often the line is redrawn at most.
const REDRAW_EVERY: Duration = Duration::from_millis(250);

/// A progress line on stderr (silent when stderr is not a terminal).
pub struct Progress {
    shown: bool,
    drawn: bool,
    last: Option<Instant>,
}

impl Progress {
    /// A progress line, shown when stderr is a terminal.
    pub fn new() -> Self {
        Self::shown_if(std::io::stderr().is_terminal())
    }

    /// A progress line shown only when `shown`.
    pub fn shown_if(shown: bool) -> Self {
        Self {
            shown,
            drawn: false,
            last: None,
        }
    }

    /// Redraws the line with `text()` unless it was drawn a moment ago.
    pub fn update(&mut self, text: impl FnOnce() -> String) {
        if !self.shown || self.last.is_some_and(|t| t.elapsed() < REDRAW_EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        self.draw(&text());
    }

    /// Redraws the line with `text` now.
    pub fn force(&mut self, text: &str) {
        if self.shown {
            self.last = Some(Instant::now());
            self.draw(text);
        }
    }

    fn draw(&mut self, text: &str) {
        let mut err = std::io::stderr().lock();
        // Carriage return, the text, then erase what a longer earlier line left.
        let _ = write!(err, "\r{text}\x1b[K");
        let _ = err.flush();
        self.drawn = true;
    }

    /// Erases the line (before the command prints its result).
    pub fn finish(&mut self) {
        if self.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
            self.drawn = false;
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `done` of `total` with a percentage: `120/400 (30%)`.
pub fn fraction(done: u64, total: u64) -> String {
    let percent = (u128::from(done) * 100)
        .checked_div(u128::from(total))
        .unwrap_or(100);
    format!("{done}/{total} ({percent}%)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions() {
        assert_eq!(fraction(120, 400), "120/400 (30%)");
        assert_eq!(fraction(0, 0), "0/0 (100%)");
        assert_eq!(
            fraction(u64::MAX, u64::MAX),
            format!("{0}/{0} (100%)", u64::MAX)
        );
    }

    #[test]
    fn a_hidden_line_draws_nothing() {
        let mut p = Progress::shown_if(false);
        p.update(|| unreachable!("not asked for text when hidden"));
        p.force("x");
        assert!(!p.drawn);
    }
}
