// Package relist generates container lifecycle events by relisting, as
// kubelet's PLEG does: it lists every pod and container periodically,
// compares the listing with the last one, and emits Started, Died, Removed
// (and optionally Changed) events for what changed.
//
// Streams miss events (a runtime restarts, a subscription breaks, a shim
// dies without an exit event); a relist finds the difference. Unlike
// kubelet's GenericPLEG it loses nothing: a pod whose inspection fails keeps
// its old record, and an event the sink refuses comes again next relist,
// with the pod's later ones (never one the sink took). Inspections of
// different pods run in parallel.
//
// Feed a Monitor with ToMonitor, and pass Relist to the monitor's WithResync
// hook to relist on every subscription: at start, and after every outage.
package relist
