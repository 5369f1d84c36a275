-- API keys and their append-only audit trail (embedded store). Times are Unix epoch
-- milliseconds, as in the PostgreSQL schema.
CREATE TABLE api_keys (
    id                     INTEGER PRIMARY KEY AUTOINCREMENT,
    public_id              TEXT    NOT NULL UNIQUE,
    name                   TEXT    NOT NULL,
    environment            TEXT    NOT NULL CHECK (environment IN ('stress', 'gray', 'prod')),
    secret_hash            BLOB    NOT NULL,
    previous_secret_hash   BLOB,
    previous_valid_until   INTEGER,
    created_at             INTEGER NOT NULL,
    created_by             TEXT    NOT NULL,
    expires_at             INTEGER,
    revoked_at             INTEGER,
    revoked_by             TEXT,
    revoke_reason          TEXT,
    allowed_models         TEXT,
    requests_per_minute    INTEGER,
    tokens_per_minute      INTEGER,
    max_concurrent_streams INTEGER,
    metadata               TEXT    NOT NULL DEFAULT '{}',
    updated_at             INTEGER NOT NULL
);
CREATE INDEX api_keys_environment ON api_keys (environment);

CREATE TABLE key_audit (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    at            INTEGER NOT NULL,
    actor         TEXT    NOT NULL,
    action        TEXT    NOT NULL,
    key_public_id TEXT,
    detail        TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX key_audit_by_key ON key_audit (key_public_id, id);

CREATE TRIGGER key_audit_no_update BEFORE UPDATE ON key_audit
BEGIN
    SELECT RAISE(ABORT, 'key_audit is append-only');
END;
CREATE TRIGGER key_audit_no_delete BEFORE DELETE ON key_audit
BEGIN
    SELECT RAISE(ABORT, 'key_audit is append-only');
END;

-- SQLite has no NOTIFY: every change bumps this counter, which gateways poll (cheaply) to
-- pick up changes made by other processes on the same file.
CREATE TABLE key_changes (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    seq INTEGER NOT NULL
);
INSERT INTO key_changes (id, seq) VALUES (1, 0);
CREATE TRIGGER api_keys_changed_ins AFTER INSERT ON api_keys
BEGIN
    UPDATE key_changes SET seq = seq + 1 WHERE id = 1;
END;
CREATE TRIGGER api_keys_changed_upd AFTER UPDATE ON api_keys
BEGIN
    UPDATE key_changes SET seq = seq + 1 WHERE id = 1;
END;
CREATE TRIGGER api_keys_changed_del AFTER DELETE ON api_keys
BEGIN
    UPDATE key_changes SET seq = seq + 1 WHERE id = 1;
END;
