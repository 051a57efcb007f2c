-- One word a meaning: "release" is a delayed event's move into the outbox when it falls due; a
-- parked event applied once the gap before it closed is "unparked". The step recorded in
-- `group_transition` for it says so, for the rows already there as well (the only rows read and
-- rewritten are those of that step).
ALTER TABLE group_transition DROP CONSTRAINT IF EXISTS group_transition_transition_check;
UPDATE group_transition SET transition = 'unparked' WHERE transition = 'released';
ALTER TABLE group_transition ADD CONSTRAINT group_transition_transition_check
    CHECK (transition IN ('duplicate', 'parked', 'unparked', 'stale', 'dead_lettered'));
