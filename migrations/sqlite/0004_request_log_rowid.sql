-- The request log without a unique index on row_id (issue 16): every row used to be inserted
-- into four B-trees (the table, row_id's index, `at`, `(key_id, at)`); now three. row_id stays
-- as a column: only rows replayed from the spill file can already be stored, and the replay
-- checks for them through the `at` index (`WHERE NOT EXISTS … at = ? AND row_id = ?`).
-- SQLite cannot drop a primary key in place: the table is rebuilt, its rows copied once.
CREATE TABLE request_log_new (
    row_id            TEXT    NOT NULL,
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
    client_addr       TEXT,
    hop_us            INTEGER
);
INSERT INTO request_log_new SELECT * FROM request_log ORDER BY at;
DROP TABLE request_log;
ALTER TABLE request_log_new RENAME TO request_log;
CREATE INDEX request_log_at ON request_log (at);
CREATE INDEX request_log_key_at ON request_log (key_id, at);
