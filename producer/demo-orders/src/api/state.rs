//! What the handlers share.

use std::sync::Arc;

use super::metrics::ApiMetrics;
use crate::exports::ExportService;
use crate::orders::OrderService;

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub orders: OrderService,
    pub exports: ExportService,
    pub metrics: Arc<ApiMetrics>,
}
