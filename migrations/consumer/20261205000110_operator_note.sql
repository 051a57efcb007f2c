-- The note an operator resolved a dead letter with is its `note`, as on the command line
-- (`--note`): `dead_letter.resolution` becomes `note` (a dead letter's `reason` stays why it
-- failed). A rename: no row is read or rewritten.
ALTER TABLE dead_letter RENAME COLUMN resolution TO note;
