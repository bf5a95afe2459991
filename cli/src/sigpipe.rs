//! Rust ignores `SIGPIPE`, so a write to a closed pipe (`pipec show DIR | head -1`) returns an
//! error and `println!` panics on it. The command-line tools restore the default action at
//! start-up, as C tools have it: the process ends quietly when its reader goes away.

/// Restore the default `SIGPIPE` action. Call first thing in `main` of a binary, never from a
/// library user's process.
pub fn restore_default() {
    #[cfg(unix)]
    // SAFETY: sets this process's disposition of one signal to the default; no handler runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
