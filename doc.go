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
//     (or Stop abandons it: a stopped monitor calls nothing more).
//   - Parallel and fair: with WithWorkers(n), up to n keys are handled at
//     once, taking turns one event at a time, so a slow or busy key never
//     holds up another for long, and not at all while a worker is free
//     (but stream intake pauses at WithIntakeLimit, which counts a slow
//     key's queue too; WithMaxQueuedPerKey bounds that queue).
//   - Exact backoff: a failed event waits in its key's queue; the queue
//     replays when due, doubling its delay after every replay that fails on
//     that event, up to a cap, and resetting once the replay gets past it.
//     Due times sit in a heap behind one clock timer: no periodic scan, no
//     idle cost, and a replay starts when its timer fires, not at a tick.
//   - Nothing vanishes: every accepted event is handled or ignored, is still
//     queued (Stats, Pending), was returned by Forget, or reaches the drop
//     handler with a reason. Stop and Shutdown hand over what is left, and
//     return about one handle timeout after the drain whatever handlers do.
//   - Clock-driven: every delay, deadline and timestamp comes from the
//     configured clock, so tests with a fake clock control retries exactly.
//
// The entry points mirror containerd's CRI event monitor (Subscribe, Start,
// Stop, Backoff) so it can be swapped in, and add Run (re-subscription with
// backoff and a resync hook) and Shutdown (drain before stopping).
package eventmonitor

// For maintainers, where each guarantee lives:
//   - order, phases, turns (a key with events left goes to the back of the
//     run queue after each call) and the backoff rules: internal/keyq;
//   - one goroutine per key: keyq's Running phase (see its doc), entered by
//     Take (a worker, call.go) and TakeAlone (an exit's watcher,
//     exitmonitor.go); an overrunning call gives its slot away but keeps
//     its key (replaceStuck); Stop ends its key's call (abandon);
//   - nothing vanishes: the identity in stats.go. An event enters it in
//     accept or refuse (or ingest, for an envelope not queued) and leaves it
//     in settle, drop or Forget; in between it is in keyq or in a call, from
//     which Stats derives the gauges;
//   - timing: scheduler.go, one timer for retries and call deadlines;
//   - stopping: stop.go, which also waits for what is being accepted
//     (Monitor.accepting) and for the scheduler and watchers.
