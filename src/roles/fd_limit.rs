//! The open-files limit of a server process: every partition keeps a descriptor for its
//! active segment, so the soft `RLIMIT_NOFILE` (often 1024) is raised to the hard limit
//! at start, and the result is logged.

/// The soft limit to ask for: the hard one, capped where "unlimited" would be refused
/// (Linux allows at most `fs.nr_open`, 1,048,576 by default). `None`: keep the current.
pub fn wanted_soft_limit(soft: u64, hard: u64) -> Option<u64> {
    const UNLIMITED_CAP: u64 = 1 << 20;
    let target = if hard == libc::RLIM_INFINITY {
        UNLIMITED_CAP
    } else {
        hard
    };
    (target > soft).then_some(target)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns (soft, hard) afterwards.
pub fn raise_open_files_limit() -> std::io::Result<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if let Some(soft) = wanted_soft_limit(limit.rlim_cur, limit.rlim_max) {
        let raised = libc::rlimit {
            rlim_cur: soft,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit.rlim_cur = soft;
    }
    Ok((limit.rlim_cur, limit.rlim_max))
}

/// [`raise_open_files_limit`], logged (a failure is a warning: the process still runs,
/// with fewer partitions possible).
pub fn raise_and_log() {
    match raise_open_files_limit() {
        Ok((soft, hard)) => tracing::info!(soft, hard, "open files limit (RLIMIT_NOFILE)"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open files limit (RLIMIT_NOFILE)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_goes_up_to_the_hard_one_never_down() {
        assert_eq!(wanted_soft_limit(1024, 524_288), Some(524_288));
        assert_eq!(wanted_soft_limit(20_000, 20_000), None);
        assert_eq!(wanted_soft_limit(1024, libc::RLIM_INFINITY), Some(1 << 20));
        assert_eq!(wanted_soft_limit(2 << 20, libc::RLIM_INFINITY), None);
    }
}
