//! The routes that read or change the databases take one of a few places at a time: each
//! group's database gives the console two connections, so a flood of such requests (a
//! thousand list reads at once) waits here, in order, for [`PLACE_WAIT`] at most, and is then
//! refused with a 503 that says so, instead of taking every connection and failing everyone's
//! requests, the overview's and the login page's included.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::refusal::Refusal;
use super::Console;

/// Requests that read or change the databases at once.
pub(super) const PLACES: usize = 4;

/// How long a request waits for a place.
pub(super) const PLACE_WAIT: Duration = Duration::from_secs(10);

/// Runs the request once it has a place, or refuses it with 503 after [`PLACE_WAIT`].
pub(super) async fn one_of_few(
    State(console): State<Console>,
    request: Request,
    next: Next,
) -> Response {
    let json = request.uri().path().starts_with("/api/");
    let place = tokio::time::timeout(PLACE_WAIT, console.inner.database_places.acquire()).await;
    match place {
        Ok(Ok(_place)) => next.run(request).await,
        _ => {
            let refusal = Refusal::unavailable(format!(
                "the console is busy: {PLACES} reads or actions at once, and this one waited {}s \
                 for its turn (try again)",
                PLACE_WAIT.as_secs()
            ));
            if json { refusal.json() } else { refusal }.into_response()
        }
    }
}
