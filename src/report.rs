//! Errors as sentences for people: the message and each cause that adds something, one per line.

use std::error::Error;

/// Formats `e` and its [`source`](Error::source) chain for a person to read: the message on the first line,
/// then `caused by: ...` for each cause whose text the lines before do not already include (many messages embed
/// their cause). Never `Debug`. The library itself does not print; binaries and examples print this.
///
/// ```
/// let e = std::io::Error::other("the disk is full");
/// assert_eq!(apex::error_report(&e), "the disk is full");
/// ```
pub fn error_report(e: &(dyn Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str("\n  caused by: ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("opening the GPU failed: {0}")]
    struct Embeds(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("opening the GPU failed")]
    struct Wraps(#[source] std::io::Error);

    #[test]
    fn causes_printed_once() {
        let e = Embeds(std::io::Error::other("no such file"));
        assert_eq!(error_report(&e), "opening the GPU failed: no such file");
        let e = Wraps(std::io::Error::other("no such file"));
        assert_eq!(
            error_report(&e),
            "opening the GPU failed\n  caused by: no such file"
        );
    }
}
