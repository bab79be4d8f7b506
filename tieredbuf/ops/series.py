"""Every Prometheus series tieredbuf exports, by the stats key it comes from (pure data:
:mod:`tieredbuf.ops.metrics` turns them into metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Series:
    """How one stats key becomes one Prometheus series."""

    key: str
    name: str
    doc: str
    type: str = "counter"  # or "gauge" (the Prometheus metric type)
    scale: float = 1.0


NS = 1e-9

PRODUCER_SERIES: tuple[Series, ...] = (
    Series("records_in", "tieredbuf_producer_records_in_total", "Records accepted by produce()."),
    Series(
        "bundles_in", "tieredbuf_producer_bundles_in_total", "Arrow bundles accepted by ingest()."
    ),
    Series(
        "bytes_in", "tieredbuf_producer_bytes_in_total", "Bytes accepted (records plus framing)."
    ),
    Series("wal_fsyncs", "tieredbuf_wal_fsyncs_total", "WAL group-commit fdatasyncs."),
    Series(
        "wal_fsync_ns",
        "tieredbuf_wal_fsync_seconds_total",
        "Time spent in WAL fdatasyncs.",
        scale=NS,
    ),
    Series("segments_sealed", "tieredbuf_segments_sealed_total", "Stage segments sealed."),
    Series(
        "segments_exported",
        "tieredbuf_segments_exported_total",
        "Sealed segments uploaded and appended to the queue.",
    ),
    Series("bytes_exported", "tieredbuf_exported_bytes_total", "Bytes of exported segments."),
    Series(
        "batches_flushed",
        "tieredbuf_batches_flushed_total",
        "Batches flushed by a stateless producer.",
    ),
    Series("objects_uploaded", "tieredbuf_uploads_total", "Data objects uploaded."),
    Series(
        "upload_ns",
        "tieredbuf_upload_seconds_total",
        "Time spent uploading data objects (retries included).",
        scale=NS,
    ),
    Series("bytes_uploaded", "tieredbuf_uploaded_bytes_total", "Bytes of data objects uploaded."),
    Series("upload_retries", "tieredbuf_upload_retries_total", "Data object PUTs retried."),
    Series("export_retries", "tieredbuf_export_retries_total", "Failed export passes (retried)."),
    Series(
        "export_permanent_failures",
        "tieredbuf_export_permanent_failures_total",
        "Export passes stopped by a permanent store error (retried slowly).",
    ),
    Series(
        "export_failing",
        "tieredbuf_export_failing",
        "1 while a permanent store error stops exports (the data stays staged).",
        type="gauge",
    ),
    Series(
        "reuploads_for_grace",
        "tieredbuf_grace_reuploads_total",
        "Objects uploaded again because their enqueue outlived half the GC grace period.",
    ),
    Series(
        "backpressure_waits",
        "tieredbuf_backpressure_waits_total",
        "Times a produce()/ingest() waited at a stage cap.",
    ),
    Series(
        "backpressure_timeouts",
        "tieredbuf_backpressure_timeouts_total",
        "BackpressureError raised by a stateless producer.",
    ),
    Series(
        "dropped_segments",
        "tieredbuf_dropped_segments_total",
        "Unexported segments deleted by size_cap_policy=drop_oldest.",
    ),
    Series("dropped_records", "tieredbuf_dropped_records_total", "Records lost to drop_oldest."),
    Series("dropped_bundles", "tieredbuf_dropped_bundles_total", "Bundles lost to drop_oldest."),
    Series(
        "segments_quarantined",
        "tieredbuf_stage_segments_quarantined_total",
        "Sealed segments that failed their CRC check and were set aside (data loss).",
    ),
    Series(
        "quarantined_segments",
        "tieredbuf_stage_quarantined_segments",
        "Quarantined (corrupt) segments in the stage now: non-zero needs an operator.",
        type="gauge",
    ),
    Series(
        "replayed_entries",
        "tieredbuf_wal_replayed_entries_total",
        "WAL entries replayed at start-up (recovery).",
    ),
    Series(
        "stage_disk_bytes",
        "tieredbuf_stage_disk_bytes",
        "WAL plus sealed segment bytes.",
        type="gauge",
    ),
    Series(
        "sealed_segments_pending",
        "tieredbuf_stage_sealed_segments",
        "Sealed segments waiting for export.",
        type="gauge",
    ),
)

STORE_ERROR_SERIES: tuple[Series, ...] = (
    Series(
        "store_transient_retries",
        "tieredbuf_store_transient_retries_total",
        "Store requests retried after a transient error (refused, timeout, 5xx, "
        "SlowDown), by role.",
    ),
    Series(
        "store_permanent_errors",
        "tieredbuf_store_permanent_errors_total",
        "Permanent store errors (credentials, access denied, missing bucket), by role.",
    ),
)
"""Exported with a ``role`` label: ``producer`` (stateless) or ``exporter`` (staged)."""

QUEUE_SERIES: tuple[Series, ...] = (
    Series(
        "conflicts",
        "tieredbuf_manifest_cas_conflicts_total",
        "Manifest CAS writes lost to another writer (re-read and retried).",
    ),
    Series(
        "retries", "tieredbuf_manifest_retries_total", "Manifest operations retried (any cause)."
    ),
    Series(
        "unknown_outcomes",
        "tieredbuf_manifest_unknown_outcomes_total",
        "Manifest writes whose outcome was unknown (decided by re-reading).",
    ),
    Series(
        "transient_errors",
        "tieredbuf_manifest_transient_errors_total",
        "Transient store errors on the manifest.",
    ),
    Series(
        "permanent_errors",
        "tieredbuf_manifest_permanent_errors_total",
        "Permanent store errors on the manifest (the operation stopped at once).",
    ),
    Series(
        "commits",
        "tieredbuf_manifest_commits_total",
        "Group commits: root CASes appending what every writer uploaded (fan-in).",
    ),
    Series(
        "appends",
        "tieredbuf_manifest_appends_total",
        "A writer's own append CASes (the Spark sink).",
    ),
    Series(
        "entries_appended", "tieredbuf_manifest_entries_appended_total", "Queue entries appended."
    ),
    Series(
        "deduplicated_appends",
        "tieredbuf_manifest_deduplicated_appends_total",
        "Appends found already landed after an unknown outcome (I2).",
    ),
    Series("manifest_reads", "tieredbuf_manifest_reads_total", "Root manifest GETs."),
    Series(
        "manifest_bytes_read", "tieredbuf_manifest_read_bytes_total", "Root manifest bytes read."
    ),
    Series("dequeues", "tieredbuf_manifest_dequeues_total", "Dequeue CASes."),
    Series("groups_written", "tieredbuf_tree_groups_written_total", "Tree group objects written."),
)

FANIN_SERIES: tuple[Series, ...] = (
    Series(
        "announcements",
        "tieredbuf_fanin_announcements_total",
        "Announcements written (appends handed to another process's committer).",
    ),
    Series(
        "announced_groups",
        "tieredbuf_fanin_announced_groups_total",
        "Writers' groups of appends carried by those announcements.",
    ),
    Series(
        "announcements_read",
        "tieredbuf_fanin_announcements_read_total",
        "Announcements of other processes read by this process's committer.",
    ),
    Series(
        "announcements_read_from_key",
        "tieredbuf_fanin_announcements_read_from_key_total",
        "Of those, announcements taken from their key's spelled-out form, without a GET.",
    ),
    Series(
        "announcements_deleted",
        "tieredbuf_fanin_announcements_deleted_total",
        "Announcements deleted once committed.",
    ),
    Series(
        "announcements_expired",
        "tieredbuf_fanin_announcements_expired_total",
        "Announcements of gone writers deleted after the GC grace period.",
    ),
    Series(
        "announcements_corrupt",
        "tieredbuf_fanin_announcements_corrupt_total",
        "Damaged announcements found (never committed; their writers time out).",
    ),
    Series(
        "announcements_held_back",
        "tieredbuf_fanin_announcements_held_back_total",
        "Turns an announcement waited behind a damaged one of its announcer.",
    ),
    Series("lists", "tieredbuf_fanin_lists_total", "LISTs of pending announcements."),
    Series(
        "root_polls",
        "tieredbuf_fanin_root_polls_total",
        "Conditional root reads while waiting for another process's commit.",
    ),
    Series(
        "releases",
        "tieredbuf_fanin_lease_releases_total",
        "Commit leases given up (the last writer of a process left).",
    ),
    Series(
        "handovers",
        "tieredbuf_fanin_lease_handovers_total",
        "Of those, leases handed to the process that announced last.",
    ),
    Series(
        "hub_retries",
        "tieredbuf_fanin_retries_total",
        "Fan-in turns retried after a transient store error.",
    ),
    Series(
        "groups_confirmed",
        "tieredbuf_fanin_groups_confirmed_total",
        "Groups of writes confirmed REMOTE: their own entries found in a manifest.",
    ),
    Series(
        "groups_unconfirmed",
        "tieredbuf_fanin_groups_unconfirmed_total",
        "Groups covered by their writer's watermark whose entries were not found "
        "(RemoteUnconfirmedError).",
    ),
    Series(
        "held_back_stale",
        "tieredbuf_fanin_held_back_stale_total",
        "Commits that held a writer back at data older than half the GC grace period.",
    ),
    Series(
        "held_back_gap",
        "tieredbuf_fanin_held_back_gap_total",
        "Commits that held a writer back at an append whose predecessor is not in.",
    ),
    Series(
        "reannounced",
        "tieredbuf_fanin_reannounced_total",
        "Groups announced again after several of the holder's commits without them.",
    ),
    Series(
        "reannounced_for_grace",
        "tieredbuf_fanin_refreshed_total",
        "Groups whose data was uploaded again before it grew stale (the GC grace rule).",
    ),
    Series(
        "announcements_damaged_deleted",
        "tieredbuf_fanin_announcements_damaged_deleted_total",
        "Damaged announcements deleted.",
    ),
    Series(
        "clock_skew_ms",
        "tieredbuf_fanin_clock_skew_seconds",
        "The commit lease holder's clock less this process's, as the last commit read "
        "bounds it (0: within the bounds).",
        type="gauge",
        scale=1e-3,
    ),
)

CONSUMER_SERIES: tuple[Series, ...] = (
    Series("batches_read", "tieredbuf_consumer_batches_read_total", "Queue entries read."),
    Series("acks", "tieredbuf_consumer_acks_total", "Entries acked."),
    Series("dequeues", "tieredbuf_consumer_dequeues_total", "Dequeues issued."),
    Series(
        "manifest_refreshes",
        "tieredbuf_consumer_manifest_refreshes_total",
        "Full manifest reads by the consumer.",
    ),
)

BUFFER_WIDE = frozenset(
    {
        "tieredbuf_queue_depth",
        "tieredbuf_queue_bytes",
        "tieredbuf_queue_oldest_age_seconds",
        "tieredbuf_queue_next_sequence",
        "tieredbuf_queue_epoch",
        "tieredbuf_manifest_bytes",
        "tieredbuf_queue_tree_levels",
        "tieredbuf_subscriber_lag_entries",
        "tieredbuf_subscriber_lag_bytes",
        "tieredbuf_subscriber_lag_seconds",
        "tieredbuf_subscriber_next_sequence",
        "tieredbuf_subscriber_lost_sequences",
        "tieredbuf_subscriber_rejected",
        "tieredbuf_subscriber_leases",
    }
)
"""Gauges every process of a buffer sees alike (multiprocess: the most recent value)."""

BUFFER_GAUGES: tuple[Series, ...] = (
    Series(
        "depth", "tieredbuf_queue_depth", "Entries queued (appended, not dequeued).", type="gauge"
    ),
    Series("bytes", "tieredbuf_queue_bytes", "Bytes of the data objects queued.", type="gauge"),
    Series(
        "oldest_age",
        "tieredbuf_queue_oldest_age_seconds",
        "Age of the oldest queued record (0 when empty).",
        type="gauge",
    ),
    Series(
        "next_sequence",
        "tieredbuf_queue_next_sequence",
        "Next sequence to be appended.",
        type="gauge",
    ),
    Series("epoch", "tieredbuf_queue_epoch", "Consumer epoch in the manifest.", type="gauge"),
    Series(
        "manifest_bytes", "tieredbuf_manifest_bytes", "Size of the root manifest.", type="gauge"
    ),
    Series(
        "tree_levels",
        "tieredbuf_queue_tree_levels",
        "Levels of the manifest tree (1: entries in the root only).",
        type="gauge",
    ),
    Series(
        "scrape_errors",
        "tieredbuf_queue_scrape_errors_total",
        "Failed reads of the manifest for these gauges.",
    ),
)


SUBSCRIBER_GAUGES: tuple[Series, ...] = (
    Series(
        "next_sequence",
        "tieredbuf_subscriber_next_sequence",
        "First sequence the subscriber still needs (its position).",
        type="gauge",
    ),
    Series(
        "lag_entries",
        "tieredbuf_subscriber_lag_entries",
        "Entries appended that the subscriber has not acked.",
        type="gauge",
    ),
    Series(
        "lag_bytes",
        "tieredbuf_subscriber_lag_bytes",
        "Bytes of the linked data objects the subscriber has not acked.",
        type="gauge",
    ),
    Series(
        "lag_seconds",
        "tieredbuf_subscriber_lag_seconds",
        "Age of the oldest entry the subscriber has not acked (0 when caught up).",
        type="gauge",
    ),
    Series(
        "lost",
        "tieredbuf_subscriber_lost_sequences",
        "Sequences it skipped after retention unlinked them (on_lost=skip), plus those "
        "it still needs that are already unlinked.",
        type="gauge",
    ),
    Series(
        "rejected",
        "tieredbuf_subscriber_rejected",
        "Shared work queues: entries rejected so far.",
        type="gauge",
    ),
    Series(
        "leases", "tieredbuf_subscriber_leases", "Shared work queues: live leases.", type="gauge"
    ),
)

CONSUMER_GAUGES: tuple[Series, ...] = (
    Series(
        "lag_sequences",
        "tieredbuf_consumer_lag_sequences",
        "Queue entries after the consumer's last ack.",
        type="gauge",
    ),
    Series(
        "lag_seconds",
        "tieredbuf_consumer_lag_seconds",
        "Age of the oldest entry not yet acked (0 when caught up).",
        type="gauge",
    ),
    Series(
        "scrape_errors",
        "tieredbuf_consumer_lag_scrape_errors_total",
        "Failed reads of the manifest for the lag gauges.",
    ),
)

GC_SERIES: tuple[Series, ...] = (
    Series("runs", "tieredbuf_gc_runs_total", "GC passes."),
    Series("listed", "tieredbuf_gc_listed_objects_total", "Data objects listed by GC."),
    Series("deleted", "tieredbuf_gc_deleted_objects_total", "Data objects deleted by GC."),
    Series("groups_deleted", "tieredbuf_gc_deleted_groups_total", "Tree group objects deleted."),
    Series(
        "failed", "tieredbuf_gc_delete_failures_total", "Deletes that failed (retried next pass)."
    ),
    Series(
        "groups_read",
        "tieredbuf_gc_groups_read_total",
        "Tree group objects GC fetched (a looping GC fetches each linked group once).",
    ),
    Series("requests", "tieredbuf_gc_requests_total", "Store requests GC passes sent."),
    Series(
        "last_run",
        "tieredbuf_gc_last_run_timestamp_seconds",
        "When the last pass ended.",
        type="gauge",
    ),
    Series(
        "last_duration",
        "tieredbuf_gc_last_duration_seconds",
        "How long the last pass took.",
        type="gauge",
    ),
    Series(
        "last_failed",
        "tieredbuf_gc_last_delete_failures",
        "Failed deletes of the last pass.",
        type="gauge",
    ),
)
