//! The export routes: submit (`POST /exports`), poll (`GET /exports/{id}`) and download
//! (`GET /exports/{id}/download`).

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use tokio_util::io::ReaderStream;
use uuid::Uuid;

use super::body::ApiJson;
use super::error::ApiError;
use super::handlers::{traceparent, truncate};
use super::state::AppState;
use crate::exports::{validate_export, ExportJob, ExportRequest};

/// Header carrying the export file's SHA-256 (lowercase hex) on a download.
pub const CHECKSUM_HEADER: &str = "x-checksum-sha256";

/// A job as answered, with where to poll it and where to download its file.
#[derive(Debug, Serialize)]
struct JobAnswer {
    #[serde(flatten)]
    job: ExportJob,
    status_url: String,
    download_url: String,
}

impl From<ExportJob> for JobAnswer {
    fn from(job: ExportJob) -> Self {
        JobAnswer {
            status_url: format!("/exports/{}", job.id),
            download_url: format!("/exports/{}/download", job.id),
            job,
        }
    }
}

/// `POST /exports`: 202 with the pending job and a `Location` header.
pub(super) async fn submit_export(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<ExportRequest>,
) -> Result<Response, ApiError> {
    let filters = validate_export(request)?;
    let job = state
        .exports
        .submit(&filters, traceparent(&headers))
        .await?;
    state
        .metrics
        .event_enqueued(demo_events::export_events::EXPORT_REQUESTED);
    tracing::info!(export_id = %job.id, ?filters, "export submitted");
    let answer = JobAnswer::from(job);
    let location = HeaderValue::from_str(&answer.status_url)
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error"))?;
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(answer),
    )
        .into_response())
}

/// `GET /exports/{id}`
pub(super) async fn get_export(
    State(state): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = export_id(id)?;
    match state.exports.get(id).await? {
        Some(job) => Ok(Json(JobAnswer::from(job)).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("export {id} not found"),
        )),
    }
}

/// `GET /exports/{id}/download`: the CSV file, streamed from disk.
pub(super) async fn download_export(
    State(state): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = export_id(id)?;
    let download = state.exports.download(id).await?;
    let checksum = download.job.checksum.clone().unwrap_or_default();
    let header_value = |s: String| {
        HeaderValue::from_str(&s)
            .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error"))
    };
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/csv; charset=utf-8"),
        ),
        (
            header::CONTENT_DISPOSITION,
            header_value(format!("attachment; filename=\"{}\"", download.file_name))?,
        ),
        (header::CONTENT_LENGTH, HeaderValue::from(download.len)),
        (header::ETAG, header_value(format!("\"{checksum}\""))?),
        (
            header::HeaderName::from_static(CHECKSUM_HEADER),
            header_value(checksum)?,
        ),
    ];
    let body = Body::from_stream(ReaderStream::new(download.file));
    Ok((headers, body).into_response())
}

fn export_id(id: Result<Path<String>, PathRejection>) -> Result<Uuid, ApiError> {
    let Path(id) = id?;
    Uuid::parse_str(&id).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("export id `{}` is not a UUID", truncate(&id, 64)),
        )
    })
}
