//! What the examples share: a `main` that prints errors as sentences (the error and its causes), not `Debug`.

use std::error::Error;
use std::process::ExitCode;

/// Runs an example's body and reports its error, if any, on stderr through [`apex::error_report`]; exits 1 on
/// error.
pub fn report(result: Result<(), Box<dyn Error>>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", apex::error_report(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
