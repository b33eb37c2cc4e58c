//! `coli`: parse the command line, run, and map failures to exit codes (2 for anything the
//! user can fix: bad arguments, missing or malformed files).

use std::process::ExitCode;

fn main() -> ExitCode {
    match coli::cli::run(std::env::args_os()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}
