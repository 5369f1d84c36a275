-- The hop cost (issue 14): what the gateway added to the first token as the kernel saw it.
ALTER TABLE request_log ADD COLUMN hop_us BIGINT;
