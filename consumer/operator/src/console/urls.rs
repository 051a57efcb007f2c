//! The console's URLs under its path prefix: every link, form action, redirect, the static
//! files' addresses, the script's fetches and the session cookie's `Path` are made here, so a
//! console mounted at `/ops/console` never points outside it. The routes themselves stay at
//! `/…` (a host nests the router at the prefix, and axum strips it before the routes see the
//! path); only what goes back to the browser carries the prefix.

use std::borrow::Cow;

/// Why a prefix cannot be the console's.
pub(super) fn refused_prefix(prefix: &str) -> Option<&'static str> {
    if prefix.is_empty() {
        return None;
    }
    if !prefix.starts_with('/') {
        return Some("it must start with `/` (or be empty: served at the root)");
    }
    if prefix.ends_with('/') {
        return Some("it must not end with `/` (the root is the empty prefix)");
    }
    if !prefix
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'/' | b'-'))
    {
        return Some("only letters, digits and `._~/-` may be in it");
    }
    if prefix[1..]
        .split('/')
        .any(|segment| segment.is_empty() || segment == "." || segment == "..")
    {
        return Some("no empty (`//`), `.` or `..` segment may be in it");
    }
    None
}

/// The console's URLs under `prefix` (a valid prefix, [`refused_prefix`]: empty or `/a/b`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Urls<'a> {
    prefix: &'a str,
}

impl<'a> Urls<'a> {
    pub(super) fn new(prefix: &'a str) -> Self {
        Urls { prefix }
    }

    /// `path` (starting with `/`, a query allowed) under the prefix; `/` is the overview.
    pub(super) fn to(&self, path: &str) -> String {
        match path {
            "/" => self.overview().to_owned(),
            _ => format!("{}{path}", self.prefix),
        }
    }

    /// The overview: the prefix itself (axum's `nest` answers `/ops`, not `/ops/`), `/` at the
    /// root.
    pub(super) fn overview(&self) -> &'a str {
        if self.prefix.is_empty() {
            "/"
        } else {
            self.prefix
        }
    }

    /// The session cookie's `Path`: the browser sends it to the console's pages alone.
    pub(super) fn cookie_path(&self) -> &'a str {
        self.overview()
    }

    /// The login form, back to `next` (a path under the prefix) after logging in.
    pub(super) fn login(&self, next: &str) -> String {
        format!("{}/login?next={}", self.prefix, url_encode(next))
    }

    /// Where to go after logging in: `next` when it is a path of this console (under its
    /// prefix), the overview otherwise. Only printable ASCII without spaces or backslashes,
    /// starting with one `/`, with no `.` or `..` segment (nor its percent-encoded form, which
    /// browsers resolve too): a browser drops tabs and newlines from a `Location`, so
    /// `/<TAB>/host` would lead to another site, and `/ops/../other-app` to another application.
    pub(super) fn after_login<'n>(&self, next: Option<&'n str>) -> Cow<'n, str> {
        match next {
            Some(n) if self.is_own(n) => Cow::Borrowed(n),
            _ => Cow::Owned(self.overview().to_owned()),
        }
    }

    fn is_own(&self, next: &str) -> bool {
        if !next.starts_with('/')
            || next.starts_with("//")
            || !next.bytes().all(|b| b.is_ascii_graphic() && b != b'\\')
        {
            return false;
        }
        let path = next.split(['?', '#']).next().unwrap_or_default();
        let dots = path.split('/').any(|segment| {
            let segment = segment.to_ascii_lowercase().replace("%2e", ".");
            segment == "." || segment == ".."
        });
        if dots {
            return false;
        }
        match next.strip_prefix(self.prefix) {
            // At the root every path is the console's; under a prefix, the prefix must end at a
            // segment's end (`/ops` owns `/ops/x`, not `/opsx`).
            Some(rest) => self.prefix.is_empty() || rest.is_empty() || rest.starts_with(['/', '?']),
            None => false,
        }
    }
}

/// Percent-encodes everything but unreserved characters and `/`.
pub(super) fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_consoles_own_paths_are_followed_after_login() {
        for prefix in ["", "/ops/console"] {
            let urls = Urls::new(prefix);
            let overview = urls.overview();
            let hostile = [
                "//evil.example/",
                "https://evil.example/",
                "evil.example",
                "/\\evil.example",
            ];
            let hostile_tails = [
                "/\t/evil.example",
                "/\n/evil.example",
                "/\r\nSet-Cookie: a=b",
                "/\\evil.example",
                "/ /evil.example",
                "/\u{202e}moc.elpmaxe",
                "/../other-app",
                "/x/%2e%2E/../other-app",
                "/./x",
            ];
            let tails = hostile_tails.iter().map(|t| format!("{prefix}{t}"));
            for next in hostile.iter().map(|n| n.to_string()).chain(tails) {
                assert_eq!(urls.after_login(Some(&next)), overview, "{next:?}");
            }
            for next in [
                "/",
                "/timeline?id=order-1&x=%09",
                "/dead-letters?group=inventory",
                "/timeline?id=../..",
            ] {
                let next = format!("{prefix}{next}");
                assert_eq!(urls.after_login(Some(&next)), next);
            }
            assert_eq!(urls.after_login(None), overview);
        }
        // Under a prefix, a path outside it is another application's.
        let urls = Urls::new("/ops/console");
        for next in ["/", "/other-app", "/ops", "/ops/consolex", "/login"] {
            assert_eq!(urls.after_login(Some(next)), "/ops/console", "{next}");
        }
        assert_eq!(urls.after_login(Some("/ops/console")), "/ops/console");
        assert_eq!(
            urls.after_login(Some("/ops/console?x=1")),
            "/ops/console?x=1"
        );
    }
}
