//! Who a request is from, once logged in: the user, their role and the CSRF token of their
//! login, as every handler behind the login sees it (the pages draw it; `session` keeps it).

use std::time::Instant;

use super::users::{constant_time_eq, Role};

/// A logged-in user, as every handler behind the login sees it.
#[derive(Clone)]
pub(super) struct Session {
    pub(super) user: String,
    pub(super) role: Role,
    pub(super) csrf: String,
    pub(super) expires: Instant,
}

impl Session {
    /// Whether the user may act.
    pub(super) fn may_act(&self) -> bool {
        self.role == Role::Operator
    }

    /// Whether `token` is the CSRF token of this login.
    pub(super) fn csrf_matches(&self, token: Option<&str>) -> bool {
        token.is_some_and(|t| constant_time_eq(t.as_bytes(), self.csrf.as_bytes()))
    }
}
