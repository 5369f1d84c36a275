-- API keys and their append-only audit trail. Times are Unix epoch milliseconds (BIGINT) so
-- the same queries run on PostgreSQL and on the embedded SQLite store.
CREATE TABLE api_keys (
    id                     BIGSERIAL PRIMARY KEY,
    public_id              TEXT    NOT NULL UNIQUE,
    name                   TEXT    NOT NULL,
    environment            TEXT    NOT NULL CHECK (environment IN ('stress', 'gray', 'prod')),
    secret_hash            BYTEA   NOT NULL,
    previous_secret_hash   BYTEA,
    previous_valid_until   BIGINT,
    created_at             BIGINT  NOT NULL,
    created_by             TEXT    NOT NULL,
    expires_at             BIGINT,
    revoked_at             BIGINT,
    revoked_by             TEXT,
    revoke_reason          TEXT,
    allowed_models         TEXT,
    requests_per_minute    BIGINT,
    tokens_per_minute      BIGINT,
    max_concurrent_streams BIGINT,
    metadata               TEXT    NOT NULL DEFAULT '{}',
    updated_at             BIGINT  NOT NULL
);
CREATE INDEX api_keys_environment ON api_keys (environment);

CREATE TABLE key_audit (
    id            BIGSERIAL PRIMARY KEY,
    at            BIGINT NOT NULL,
    actor         TEXT   NOT NULL,
    action        TEXT   NOT NULL,
    key_public_id TEXT,
    detail        TEXT   NOT NULL DEFAULT '{}'
);
CREATE INDEX key_audit_by_key ON key_audit (key_public_id, id);

CREATE FUNCTION key_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'key_audit is append-only';
END
$$;
CREATE TRIGGER key_audit_append_only BEFORE UPDATE OR DELETE ON key_audit
    FOR EACH ROW EXECUTE FUNCTION key_audit_append_only();

-- Every gateway LISTENs on this channel and reloads the named key at once.
CREATE FUNCTION api_keys_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('fleetgate_keys', OLD.public_id);
    ELSE
        PERFORM pg_notify('fleetgate_keys', NEW.public_id);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER api_keys_notify AFTER INSERT OR UPDATE OR DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION api_keys_notify();
