-- Prompt tokens served from the engine's prefix cache: what the gateway predicted on the
-- backend it chose (`kv_events` and `longest_prefix` routing), and what the engine reported
-- (`cached_tokens` in the answer's usage). NULL where there was no prediction or no report.
ALTER TABLE request_log ADD COLUMN predicted_cached_tokens BIGINT;
ALTER TABLE request_log ADD COLUMN cached_tokens BIGINT;
