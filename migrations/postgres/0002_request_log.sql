-- One row per request, written in batches by the gateway's background writer. Partitioned by
-- day on `at` (epoch milliseconds); the writer creates each day's partition ahead of time and
-- drops the ones older than request_log.retention_days. The default partition catches rows
-- that arrive for a day whose partition does not exist yet, so nothing is ever refused.
CREATE TABLE request_log (
    row_id            TEXT    NOT NULL,
    at                BIGINT  NOT NULL,
    request_id        TEXT    NOT NULL,
    key_id            TEXT,
    environment       TEXT,
    model             TEXT,
    backend           TEXT,
    status            INTEGER NOT NULL,
    error             TEXT,
    stream            INTEGER NOT NULL,
    prompt_tokens     BIGINT,
    completion_tokens BIGINT,
    usage_source      TEXT    NOT NULL,
    queue_wait_us     BIGINT,
    upstream_ttft_us  BIGINT,
    client_ttft_us    BIGINT,
    overhead_pre_us   BIGINT,
    overhead_relay_us BIGINT,
    e2el_us           BIGINT,
    tpot_us           BIGINT,
    itl_mean_us       BIGINT,
    itl_p99_us        BIGINT,
    itl_max_us        BIGINT,
    content_events    INTEGER NOT NULL,
    client_addr       TEXT,
    PRIMARY KEY (row_id, at)
) PARTITION BY RANGE (at);
CREATE TABLE request_log_default PARTITION OF request_log DEFAULT;
CREATE INDEX request_log_at ON request_log (at);
CREATE INDEX request_log_key_at ON request_log (key_id, at);
