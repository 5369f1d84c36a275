//! What the command line prints on stdout. A reader that stops reading (`fleetgate keys list |
//! head -1`, a pager quit early) is not an error of the command: the first write that finds
//! the pipe closed ends the process quietly with status 0, where `println!` would panic with a
//! backtrace. Any other failure to write is reported on stderr, with status 74 (EX_IOERR).

use std::io::Write;

/// Print a line on stdout (`println!` that survives a closed pipe).
#[macro_export]
macro_rules! outln {
    () => {
        $crate::cli_out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli_out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Print on stdout without a newline, flushed at once.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli_out::write(format_args!($($arg)*))
    };
}

/// EX_IOERR (sysexits.h): stdout could not be written for another reason than a closed pipe.
pub(crate) const EXIT_IO: i32 = 74;

/// Write to stdout and flush; on a closed pipe end quietly, on another error say so and end.
pub fn write(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("fleetgate: cannot write to stdout: {e}");
        std::process::exit(EXIT_IO);
    }
}
