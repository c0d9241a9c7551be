// Package eventmonitor turns a container runtime's event stream into
// reliable, ordered, per-key handling with exponential backoff. It is what a
// CRI plugin or a custom runtime embeds instead of writing its own event loop.
//
// Events come from a Subscriber (through a Converter that types and keys
// them), from Submit, or from WatchExit, and go to a Handler. The monitor
// guarantees:
//
//   - Ordered: events of one key are handled one at a time, in the order
//     accepted. While a key is in backoff, its new events queue behind it.
//   - One path per key: no two handler calls for a key ever overlap, not even
//     when a call overruns its timeout; the key stays held until it returns
//     (or Stop abandons it: no handler call begins once Stop returned).
//   - Parallel and fair: with WithWorkers(n), n workers handle keys at
//     once (exits may also be handled inline, and an overrunning call's
//     worker is replaced, see WithMaxOverruns), taking turns one event at
//     a time, so a slow or busy key never holds up another for long, and
//     not at all while a worker is free (but stream intake pauses at
//     WithIntakeLimit, which counts a slow key's queue too;
//     WithMaxQueuedPerKey bounds that queue).
//   - Exact backoff: a failed event waits in its key's queue; the queue
//     replays when due, doubling its delay after every replay that fails on
//     that event, up to a cap, and resetting once the replay gets past it.
//     Due times sit in a heap behind one clock timer: no periodic scan, no
//     idle cost, and a replay starts when its timer fires, not at a tick.
//   - Nothing vanishes: every accepted event is handled or ignored, is still
//     queued (Stats, Pending), was returned by Forget, or reaches the drop
//     handler with a reason. Stop and Shutdown hand over what is left, and
//     return about one handle timeout after the drain whatever handlers do
//     (with a handle timeout; see Stop for the callbacks it waits for).
//   - Clock-driven: every delay, deadline and timestamp comes from the
//     configured clock, so tests with a fake clock control retries exactly.
//
// The entry points mirror containerd's CRI event monitor (Subscribe, Start,
// Stop, Backoff) so it can be swapped in, and add Run (re-subscription with
// backoff and a resync hook) and Shutdown (drain before stopping).
package eventmonitor

// For maintainers, where each guarantee lives:
//   - Ordered, and Exact backoff's rules: internal/keyq's package doc.
//   - One path per key: keyq's Running phase, entered by Take (takeReady,
//     call.go) and TakeAlone (queueExit, exitmonitor.go) only while the
//     lifecycle handles, and left when the call settles (settle, or
//     release once a dropped event's drop was handed over) or at Stop
//     (abandon, stop.go).
//   - Parallel and fair: reconcile's loop over free slots (monitor.go),
//     release passing a slot on (call.go), replaceStuck (scheduler.go);
//     turns in keyq's Done; the intake pause in ingest (intake.go).
//   - Exact backoff's timing and Clock-driven: reconcile replays what is
//     due; scheduler.go's one timer wakes it and ends calls' ctx at their
//     deadline (expire). Time is read only through the configured clock.
//   - Nothing vanishes: the identity in stats.go. An event enters it in
//     accept or refuse (or ingest, for an envelope not queued) and leaves
//     it in settle, drop or Forget; in between it is in keyq or in a call,
//     from which Stats derives the gauges. Stop hands over what is left in
//     finishStop once nothing is being accepted and the scheduler and
//     watchers are gone; it returns in bounded time because its loop
//     abandons each call expire marks overran.
//   - User code cannot take the monitor down: errors.go says how each
//     callback is guarded (log hooks are not: their panic is the
//     process's). A handler ending its goroutine (runtime.Goexit) fails its
//     call, and so does a log hook on its retry line (handle,
//     settleExited). Wherever else a callback's Goexit would leave a key, a
//     slot, a count or a place held, the bookkeeping is deferred: a
//     worker's report (reportThenRelease), the scheduler's log lines
//     (logOverruns), Start's reader (which then reports it on Start's
//     channel), Run's place, an exit watcher, the accepting count
//     (endAccepting) and a bare Start's channel (finishStop).
