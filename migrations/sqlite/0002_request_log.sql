-- One row per request (embedded store). Retention deletes rows older than
-- request_log.retention_days.
CREATE TABLE request_log (
    row_id            TEXT    NOT NULL PRIMARY KEY,
    at                INTEGER NOT NULL,
    request_id        TEXT    NOT NULL,
    key_id            TEXT,
    environment       TEXT,
    model             TEXT,
    backend           TEXT,
    status            INTEGER NOT NULL,
    error             TEXT,
    stream            INTEGER NOT NULL,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    usage_source      TEXT    NOT NULL,
    queue_wait_us     INTEGER,
    upstream_ttft_us  INTEGER,
    client_ttft_us    INTEGER,
    overhead_pre_us   INTEGER,
    overhead_relay_us INTEGER,
    e2el_us           INTEGER,
    tpot_us           INTEGER,
    itl_mean_us       INTEGER,
    itl_p99_us        INTEGER,
    itl_max_us        INTEGER,
    content_events    INTEGER NOT NULL,
    client_addr       TEXT
);
CREATE INDEX request_log_at ON request_log (at);
CREATE INDEX request_log_key_at ON request_log (key_id, at);
