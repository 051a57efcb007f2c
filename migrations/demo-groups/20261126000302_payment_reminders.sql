-- The notification group sends a payment reminder only for an order it has not seen paid or
-- cancelled: this index answers that question for the few reminder events, and holds only the
-- rows it needs.
CREATE INDEX IF NOT EXISTS notification_settled_order_idx ON notification (order_id)
    WHERE template IN ('payment-received', 'order-cancelled');
