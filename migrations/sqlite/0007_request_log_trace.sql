-- The W3C trace the request joined (its `traceparent`'s trace id, 32 hex digits), so a row
-- and a trace find each other.
ALTER TABLE request_log ADD COLUMN trace_id TEXT;
