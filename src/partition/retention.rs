//! Which segments retention deletes: a pure function of segment summaries and the policy.
//!
//! Whole segments only, oldest first, and never a segment holding offsets at or above the
//! high watermark (consumers may not have seen them). A segment goes when its newest
//! record is older than `retention.ms`, or while the log exceeds `retention.bytes` by at
//! least that segment's size.

/// What retention needs to know of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSummary {
    /// Offset after the segment's last record.
    pub next_offset: u64,
    /// Bytes in its `.log` file.
    pub size: u64,
    /// Its largest record timestamp (-1 when empty).
    pub max_timestamp: i64,
}

/// How many segments, from the oldest, retention deletes. `segments` is in offset order.
pub fn segments_to_delete(
    segments: &[SegmentSummary],
    now_ms: i64,
    retention_ms: i64,
    retention_bytes: i64,
    high_watermark: u64,
) -> usize {
    let deletable = segments
        .iter()
        .take_while(|s| s.size > 0 && s.next_offset <= high_watermark)
        .count();
    let by_time = if retention_ms < 0 {
        0
    } else {
        segments[..deletable]
            .iter()
            .take_while(|s| now_ms.saturating_sub(s.max_timestamp) > retention_ms)
            .count()
    };
    let by_size = if retention_bytes < 0 {
        0
    } else {
        let total: u64 = segments.iter().map(|s| s.size).sum();
        let mut excess = total.saturating_sub(retention_bytes as u64);
        segments[..deletable]
            .iter()
            .take_while(|s| {
                let fits = excess >= s.size;
                if fits {
                    excess -= s.size;
                }
                fits
            })
            .count()
    };
    by_time.max(by_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(next_offset: u64, size: u64, max_timestamp: i64) -> SegmentSummary {
        SegmentSummary {
            next_offset,
            size,
            max_timestamp,
        }
    }

    #[test]
    fn time_retention_deletes_old_prefix_only() {
        let s = [
            seg(10, 100, 1_000),
            seg(20, 100, 5_000),
            seg(30, 100, 1_500),
        ];
        assert_eq!(segments_to_delete(&s, 10_000, 6_000, -1, 30), 1);
        assert_eq!(segments_to_delete(&s, 20_000, 6_000, -1, 30), 3);
        assert_eq!(segments_to_delete(&s, 20_000, -1, -1, 30), 0);
    }

    #[test]
    fn size_retention_keeps_the_log_under_the_limit() {
        let s = [seg(10, 100, 0), seg(20, 100, 0), seg(30, 100, 0)];
        assert_eq!(segments_to_delete(&s, 0, -1, 250, 30), 0);
        assert_eq!(segments_to_delete(&s, 0, -1, 200, 30), 1);
        assert_eq!(segments_to_delete(&s, 0, -1, 0, 30), 3);
    }

    #[test]
    fn nothing_at_or_above_the_high_watermark_is_deleted() {
        let s = [seg(10, 100, 0), seg(20, 100, 0), seg(30, 100, 0)];
        assert_eq!(segments_to_delete(&s, 1 << 40, 1, 0, 15), 1);
        assert_eq!(segments_to_delete(&s, 1 << 40, 1, 0, 0), 0);
    }

    #[test]
    fn empty_segments_stop_deletion() {
        let s = [seg(10, 100, 0), seg(10, 0, -1)];
        assert_eq!(segments_to_delete(&s, 1 << 40, 1, -1, 10), 1);
    }
}
