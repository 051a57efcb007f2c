//! The inventory's decisions, made in memory on what a transaction read: reserve an order's
//! quantities (or reject the reservation when stock is short), release or settle a reservation.

use std::collections::BTreeMap;

use consumer::HandlerError;
use demo_events::order_events::OrderSnapshot;

use super::{Decision, InventoryTransaction, Reservation};

impl InventoryTransaction {
    /// Makes `decision` on the transaction's view (everything it needs is read) and remembers it.
    pub(super) fn decide(&mut self, decision: Decision) {
        match &decision {
            Decision::Reserve { order_id, wanted } => self.reserve(order_id, wanted),
            Decision::Close { order_id, to } => self.close_reservation(order_id, to),
        }
        self.decisions.push(decision);
    }

    /// Reserves `wanted` for `order_id` when every product has enough available, and otherwise
    /// records the reservation as rejected with what was short.
    fn reserve(&mut self, order_id: &str, wanted: &BTreeMap<String, i32>) {
        let short: Vec<String> = wanted
            .iter()
            .filter_map(|(p, q)| {
                let have = self
                    .stock
                    .get(p)
                    .copied()
                    .flatten()
                    .map(|s| s.available)
                    .unwrap_or(0);
                (have < *q).then(|| format!("{p} (wanted {q}, available {have})"))
            })
            .collect();
        let reservation = if short.is_empty() {
            for (p, q) in wanted {
                if let Some(Some(s)) = self.stock.get_mut(p) {
                    s.available -= q;
                    s.reserved += q;
                    let _ = self.changed_stock.insert(p.clone());
                }
            }
            Reservation {
                status: "reserved",
                reason: None,
                lines: wanted.clone(),
                new_lines: true,
            }
        } else {
            let reason = Some(format!("insufficient stock: {}", short.join(", ")));
            Reservation {
                status: "rejected",
                reason,
                lines: BTreeMap::new(),
                new_lines: false,
            }
        };
        let _ = self
            .reservations
            .insert(order_id.to_owned(), Some(reservation));
        let _ = self.changed_reservations.insert(order_id.to_owned());
    }

    /// Moves a `reserved` reservation to `to`, returning its stock: to available when released,
    /// out of the warehouse when fulfilled. Anything else (rejected, none) changes nothing.
    fn close_reservation(&mut self, order_id: &str, to: &'static str) {
        let lines = match self.reservations.get(order_id) {
            Some(Some(r)) if r.status == "reserved" => r.lines.clone(),
            _ => return,
        };
        for (p, q) in &lines {
            if let Some(Some(s)) = self.stock.get_mut(p) {
                s.reserved -= q;
                if to == "released" {
                    s.available += q;
                }
                let _ = self.changed_stock.insert(p.clone());
            }
        }
        if let Some(Some(r)) = self.reservations.get_mut(order_id) {
            r.status = to;
        }
        let _ = self.changed_reservations.insert(order_id.to_owned());
    }
}

pub(super) fn quantities(order: &OrderSnapshot) -> Result<BTreeMap<String, i32>, HandlerError> {
    let mut wanted: BTreeMap<String, i32> = BTreeMap::new();
    for line in &order.lines {
        if line.quantity <= 0 {
            return Err(HandlerError::Rejected(format!(
                "line for {} has quantity {}",
                line.product_id, line.quantity
            )));
        }
        let q = wanted.entry(line.product_id.clone()).or_insert(0);
        *q = q.checked_add(line.quantity).ok_or_else(|| {
            HandlerError::Rejected(format!("quantity of {} overflows", line.product_id))
        })?;
    }
    Ok(wanted)
}
