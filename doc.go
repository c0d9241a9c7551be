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
//     when a call overruns its timeout; the key stays held until it returns.
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
//     handler with a reason. Stop and Shutdown hand over what is left, and return
//     about one handle timeout after the drain whatever handlers do.
//   - Clock-driven: every delay, deadline and timestamp comes from the
//     configured clock, so tests with a fake clock control retries exactly.
//
// Where each guarantee lives: the order, the phases, the turns (a key with
// events left goes to the back of the run queue after each call) and the
// backoff rules in internal/keyq; one goroutine per key in keyq's Running
// phase, which only a call's start and end change (call.go); the accounting
// in Stats, whose identity every counter and gauge takes part in (stats.go);
// the timing in scheduler.go; stopping in stop.go.
//
// The entry points mirror containerd's CRI event monitor (Subscribe, Start,
// Stop, Backoff) so it can be swapped in, and add Run (re-subscription with
// backoff and a resync hook) and Shutdown (drain before stopping).
package eventmonitor
