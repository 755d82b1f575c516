//! The fault schedule: a list of timed faults generated from a seed alone (a SplitMix64
//! generator, no global randomness), so a failing seed replays the same schedule. At
//! most two faults overlap, and never two that touch controllers or two that touch
//! brokers, so a controller majority and two in-sync replicas can keep working; every
//! fault ends (heals) by the end of the window.

use std::fmt;
use std::time::Duration;

use super::cluster::{BROKERS, CONTROLLERS};

/// SplitMix64: small, fast, and the same sequence everywhere for a seed.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "empty range");
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

/// One fault; node indices as in [`super::cluster`] (controllers first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// kill -9, restarted when the fault ends.
    Kill(usize),
    /// SIGSTOP, SIGCONT when the fault ends.
    Pause(usize),
    /// The node loses every link to the other nodes (clients still reach it).
    Isolate(usize),
    /// Whichever controller leads the quorum when the fault starts is isolated.
    IsolateControllerLeader,
    /// The link between two brokers is cut.
    CutBrokers(usize, usize),
    /// A minority (one controller, one broker) is cut off from the majority.
    Split { controller: usize, broker: usize },
    /// A broker's disk fills; when the fault ends the space is freed and the broker is
    /// restarted (a failed write takes a partition offline until restart).
    DiskFull(usize),
}

impl Fault {
    /// Whether it touches a controller / a broker (for the overlap rule).
    fn touches(&self) -> (bool, bool) {
        let controller = |i: usize| i < CONTROLLERS;
        match self {
            Fault::Kill(i) | Fault::Pause(i) | Fault::Isolate(i) => {
                (controller(*i), !controller(*i))
            }
            Fault::IsolateControllerLeader => (true, false),
            Fault::CutBrokers(..) | Fault::DiskFull(_) => (false, true),
            Fault::Split { .. } => (true, true),
        }
    }

    /// A short name for the summary.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Kill(_) => "kill9",
            Fault::Pause(_) => "pause",
            Fault::Isolate(_) => "isolate",
            Fault::IsolateControllerLeader => "isolate-leader",
            Fault::CutBrokers(..) => "cut-brokers",
            Fault::Split { .. } => "split",
            Fault::DiskFull(_) => "disk-full",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |i: usize| {
            if i < CONTROLLERS {
                format!("c{}", i + 1)
            } else {
                format!("b{}", i - CONTROLLERS + 1)
            }
        };
        match self {
            Fault::Kill(i) => write!(f, "kill9 {}", name(*i)),
            Fault::Pause(i) => write!(f, "pause {}", name(*i)),
            Fault::Isolate(i) => write!(f, "isolate {}", name(*i)),
            Fault::IsolateControllerLeader => write!(f, "isolate controller leader"),
            Fault::CutBrokers(a, b) => write!(f, "cut {}<->{}", name(*a), name(*b)),
            Fault::Split { controller, broker } => {
                write!(
                    f,
                    "split {{{},{}}} from the rest",
                    name(*controller),
                    name(*broker)
                )
            }
            Fault::DiskFull(i) => write!(f, "disk-full {}", name(*i)),
        }
    }
}

/// A fault and when it starts and ends, from the start of the window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub start: Duration,
    pub end: Duration,
    pub fault: Fault,
}

/// The schedule for `seed` over `window`.
pub fn generate(seed: u64, window: Duration) -> Vec<Event> {
    let mut rng = Rng::new(seed);
    let mut events: Vec<Event> = Vec::new();
    let mut t = rng.millis(1_000, 2_500);
    // Bounded: each step advances time by at least 300 ms.
    while t + Duration::from_secs(2) < window {
        let fault = random_fault(&mut rng);
        let length = rng.millis(2_000, 7_000);
        let end = (t + length).min(window);
        let (c, b) = fault.touches();
        let busy = events.iter().filter(|e| e.end > t).collect::<Vec<_>>();
        let clash = busy.len() >= 2
            || busy.iter().any(|e| {
                let (ec, eb) = e.fault.touches();
                (c && ec) || (b && eb)
            });
        if !clash {
            events.push(Event {
                start: t,
                end,
                fault,
            });
        }
        t += rng.millis(300, 3_000);
    }
    events
}

fn random_fault(rng: &mut Rng) -> Fault {
    let any_controller = |rng: &mut Rng| rng.below(CONTROLLERS as u64) as usize;
    let any_broker = |rng: &mut Rng| CONTROLLERS + rng.below(BROKERS as u64) as usize;
    let any_node = |rng: &mut Rng| rng.below((CONTROLLERS + BROKERS) as u64) as usize;
    match rng.below(10) {
        0 | 1 => Fault::Kill(any_node(rng)),
        2 => Fault::Pause(any_node(rng)),
        3 | 4 => Fault::Isolate(any_node(rng)),
        5 => Fault::IsolateControllerLeader,
        6 => {
            let a = any_broker(rng);
            let b = CONTROLLERS
                + (a - CONTROLLERS + 1 + rng.below(BROKERS as u64 - 1) as usize) % BROKERS;
            Fault::CutBrokers(a.min(b), a.max(b))
        }
        7 => Fault::Split {
            controller: any_controller(rng),
            broker: any_broker(rng),
        },
        _ => Fault::DiskFull(any_broker(rng)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_always_gives_the_same_schedule() {
        let a = generate(7, Duration::from_secs(60));
        assert_eq!(a, generate(7, Duration::from_secs(60)));
        assert_ne!(a, generate(8, Duration::from_secs(60)));
        assert!(!a.is_empty());
    }

    #[test]
    fn faults_overlap_at_most_two_at_a_time_and_end_in_the_window() {
        for seed in 0..200 {
            let window = Duration::from_secs(40);
            let events = generate(seed, window);
            for e in &events {
                assert!(e.start < e.end && e.end <= window, "{seed}: {e:?}");
                // The most faults at once is reached at some fault's start.
                let overlapping: Vec<&Event> = events
                    .iter()
                    .filter(|o| o.start <= e.start && e.start < o.end)
                    .collect();
                assert!(overlapping.len() <= 2, "{seed}: {overlapping:?}");
                let controllers = overlapping.iter().filter(|o| o.fault.touches().0).count();
                let brokers = overlapping.iter().filter(|o| o.fault.touches().1).count();
                assert!(controllers <= 1 && brokers <= 1, "{seed}: {overlapping:?}");
            }
        }
    }

    #[test]
    fn cut_brokers_names_two_distinct_brokers() {
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            if let Fault::CutBrokers(a, b) = random_fault(&mut rng) {
                assert!(a < b && a >= CONTROLLERS && b < CONTROLLERS + BROKERS);
            }
        }
    }
}
