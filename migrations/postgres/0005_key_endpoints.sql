-- The endpoint families a key may call (issue 32): a JSON list such as ["chat","embeddings"];
-- NULL allows every family.
ALTER TABLE api_keys ADD COLUMN allowed_endpoints TEXT;
