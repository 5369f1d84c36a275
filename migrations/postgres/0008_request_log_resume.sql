-- A stream resumed on another backend when its own died mid-answer ([pools.resume]):
-- continuations sent (NULL: the stream never failed), the failed parts and a refusal's reason
-- as JSON ({"parts":[{"backend","cause","tokens"}],"refused":"..."}), and the tokens the fleet
-- spent on the request (the usage the client was told, plus every continuation's prompt).
ALTER TABLE request_log ADD COLUMN resumes INTEGER;
ALTER TABLE request_log ADD COLUMN resume_detail TEXT;
ALTER TABLE request_log ADD COLUMN fleet_tokens BIGINT;
