-- A request answered by a fallback pool (issue 62): the model it was routed to first, and
-- each pool it left with why, as JSON ([{"model","cause"}]); NULL when it never fell back.
-- The row's `model` is the pool that answered.
ALTER TABLE request_log ADD COLUMN fallback_from TEXT;
ALTER TABLE request_log ADD COLUMN fallback_detail TEXT;
