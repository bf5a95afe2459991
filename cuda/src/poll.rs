//! Waiting for the GPU with a bound: the CUDA backend never blocks in a call without a
//! timeout, so that a hang becomes a report.

use std::time::{Duration, Instant};

/// Call `done` until it says `true` (then `Ok(true)`) or `timeout` has passed (`Ok(false)`),
/// sleeping briefly between calls. The GPU is polled (`cuEventQuery` through
/// `CudaEvent::try_is_complete`) rather than waited on with `cuEventSynchronize`/
/// `cuStreamSynchronize`, which have no timeout: a hang must become a report.
pub fn poll_until<E>(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool, E>,
) -> Result<bool, E> {
    let t0 = Instant::now();
    loop {
        if done()? {
            return Ok(true);
        }
        if t0.elapsed() > timeout {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[cfg(test)]
mod tests {
    use super::poll_until;
    use std::time::Duration;

    /// Polling ends as soon as the condition holds, gives up (without an error) when it never
    /// does, and passes an error of the query straight through.
    #[test]
    fn poll_until_returns_done_times_out_and_forwards_errors() {
        let mut calls = 0;
        let r: Result<bool, ()> = poll_until(Duration::from_secs(60), || {
            calls += 1;
            Ok(calls == 3)
        });
        assert_eq!((r, calls), (Ok(true), 3));
        let r: Result<bool, ()> = poll_until(Duration::from_millis(1), || Ok(false));
        assert_eq!(r, Ok(false));
        let r: Result<bool, &str> = poll_until(Duration::from_secs(60), || Err("lost"));
        assert_eq!(r, Err("lost"));
    }
}
