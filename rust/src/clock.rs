//! Deadlines on the monotonic clock, the one place that turns a span into an instant: a span
//! too long for the clock (a peer's value, a user's "no timeout") is as good as none and must
//! not panic.

use std::time::{Duration, Instant};
#[cfg(any(feature = "python", test))]
use std::time::{SystemTime, UNIX_EPOCH};

/// How far "never" is: further than any deadline the crate keeps matters.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// `now + span`, or a year from `now` when that overflows the clock.
pub(crate) fn later(now: Instant, span: Duration) -> Instant {
    now.checked_add(span).or_else(|| now.checked_add(NEVER)).unwrap_or(now)
}

/// [`later`] than now.
pub(crate) fn deadline_after(span: Duration) -> Instant {
    later(Instant::now(), span)
}

/// The monotonic instant of `unix_s`, seconds since the Unix epoch on the wall clock (both
/// clocks read together): now once it has passed. `unix_s` must be finite; NaN is now.
#[cfg(any(feature = "python", test))] // (the Python bindings' conversion)
pub(crate) fn instant_of_unix(unix_s: f64) -> Instant {
    let (now, wall) = (Instant::now(), SystemTime::now());
    let wall = wall.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    let ahead = Duration::try_from_secs_f64((unix_s - wall).max(0.0)).unwrap_or(NEVER);
    later(now, ahead)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_past_the_clock_are_a_year() {
        let now = Instant::now();
        assert_eq!(later(now, Duration::from_secs(5)), now + Duration::from_secs(5));
        assert_eq!(later(now, Duration::MAX), now + NEVER);
    }

    #[test]
    fn unix_moments_past_are_now_and_those_ahead_keep_their_distance() {
        let before = Instant::now();
        assert!(instant_of_unix(0.0) >= before && instant_of_unix(0.0) <= Instant::now());
        assert!(instant_of_unix(f64::MAX) >= before + NEVER);
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
        let soon = instant_of_unix(wall + 10.0);
        let ahead = soon.saturating_duration_since(Instant::now());
        let slack = Duration::from_millis(1); // (f64 seconds since 1970 round to ~0.2 us)
        assert!(ahead > Duration::from_secs(9) && ahead <= Duration::from_secs(10) + slack);
    }
}
