// Package prometheus exports an eventmonitor.Monitor's metrics to
// Prometheus.
//
// A Collector is two things at once: the monitor's eventmonitor.Metrics,
// which records handler durations, recovery times and drops by reason as
// they happen, and a prometheus.Collector, which reads the monitor's counters
// and gauges from Stats when scraped. Counters therefore cost nothing on the
// event path and always agree with Stats.
//
// It lives in its own module so that the library does not depend on
// client_golang.
package prometheus

import (
	"errors"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/eventmonitor/eventmonitor"
)

// Option configures a Collector.
type Option func(*settings)

type settings struct {
	namespace, subsystem string
	constLabels          prometheus.Labels
	durationBuckets      []float64
	recoveryBuckets      []float64
}

// WithNamespace sets the first part of every metric name; default
// "eventmonitor". An empty namespace is allowed.
func WithNamespace(ns string) Option { return func(s *settings) { s.namespace = ns } }

// WithSubsystem sets the part of the name after the namespace; default none.
func WithSubsystem(sub string) Option { return func(s *settings) { s.subsystem = sub } }

// WithConstLabels adds labels to every metric, to tell several monitors of
// one process apart.
func WithConstLabels(l prometheus.Labels) Option {
	return func(s *settings) { s.constLabels = l }
}

// WithDurationBuckets sets the handler duration histogram's buckets, in
// seconds; default 100 µs to about 26 s, ×4 per bucket.
func WithDurationBuckets(b []float64) Option { return func(s *settings) { s.durationBuckets = b } }

// WithRecoveryBuckets sets the buckets of the time from an event's first
// failure to its successful retry, in seconds; default 0.5 s to about 68 min,
// ×2 per bucket (the default backoff doubles from 1 s to 5 min).
func WithRecoveryBuckets(b []float64) Option { return func(s *settings) { s.recoveryBuckets = b } }

// Collector implements eventmonitor.Metrics and prometheus.Collector.
// Create it with New, pass it to eventmonitor.WithMetrics, then Watch the
// monitor and register the Collector.
type Collector struct {
	monitor atomic.Pointer[eventmonitor.Monitor]

	handlerDuration *prometheus.HistogramVec
	recovery        prometheus.Histogram
	dropped         *prometheus.CounterVec

	counters []statCounter
	gauges   []statGauge
}

type statCounter struct {
	desc  *prometheus.Desc
	value func(eventmonitor.Stats) uint64
}

type statGauge struct {
	desc  *prometheus.Desc
	value func(eventmonitor.Stats) int
}

// Drop reasons as they appear in the dropped counter's reason label.
const (
	ReasonDecode      = "decode"       // the payload could not be unmarshalled
	ReasonInvalid     = "invalid"      // empty or oversized key, nil event, converter panic
	ReasonMaxAttempts = "max_attempts" // WithMaxAttempts reached
	ReasonQueueFull   = "queue_full"   // WithMaxQueuedPerKey reached
	ReasonStopped     = "stopped"      // still pending at Stop or Shutdown
	ReasonOther       = "other"
)

var reasons = []struct {
	sentinel error
	label    string
}{
	// ErrStopped first: a call that failed during shutdown wraps the
	// handler's error too, which may be anything.
	{eventmonitor.ErrStopped, ReasonStopped},
	{eventmonitor.ErrMaxAttempts, ReasonMaxAttempts},
	{eventmonitor.ErrQueueFull, ReasonQueueFull},
	{eventmonitor.ErrDecode, ReasonDecode},
	{eventmonitor.ErrInvalidEvent, ReasonInvalid},
}

// Reason returns the reason label for a drop's error.
func Reason(err error) string {
	for _, r := range reasons {
		if errors.Is(err, r.sentinel) {
			return r.label
		}
	}
	return ReasonOther
}

// New returns a Collector with no monitor to read yet: until Watch, a scrape
// reports only what was recorded through the Metrics methods.
func New(opts ...Option) *Collector {
	s := settings{
		namespace:       "eventmonitor",
		durationBuckets: prometheus.ExponentialBuckets(0.0001, 4, 10),
		recoveryBuckets: prometheus.ExponentialBuckets(0.5, 2, 14),
	}
	for _, opt := range opts {
		opt(&s)
	}
	name := func(n string) string { return prometheus.BuildFQName(s.namespace, s.subsystem, n) }
	desc := func(n, help string) *prometheus.Desc {
		return prometheus.NewDesc(name(n), help, nil, s.constLabels)
	}
	c := &Collector{
		handlerDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: s.namespace, Subsystem: s.subsystem, ConstLabels: s.constLabels,
			Name:    "handler_duration_seconds",
			Help:    "Duration of event handler calls, by result (success or error).",
			Buckets: s.durationBuckets,
		}, []string{"result"}),
		recovery: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: s.namespace, Subsystem: s.subsystem, ConstLabels: s.constLabels,
			Name:    "recovery_duration_seconds",
			Help:    "Time from an event's first failed handler call to its successful retry.",
			Buckets: s.recoveryBuckets,
		}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: s.namespace, Subsystem: s.subsystem, ConstLabels: s.constLabels,
			Name: "events_dropped_total",
			Help: "Events the monitor gave up on, by reason.",
		}, []string{"reason"}),
		counters: []statCounter{
			{desc("events_received_total", "Envelopes read from the stream and events submitted."),
				func(s eventmonitor.Stats) uint64 { return s.Received }},
			{desc("events_filtered_total", "Envelopes of other namespaces, not handled."),
				func(s eventmonitor.Stats) uint64 { return s.Filtered }},
			{desc("events_ignored_total", "Envelopes of types the converter has no key for, not handled (not drops)."),
				func(s eventmonitor.Stats) uint64 { return s.Ignored }},
			{desc("events_handled_total", "Successful handler calls."),
				func(s eventmonitor.Stats) uint64 { return s.Handled }},
			{desc("events_failed_total", "Failed handler calls, panics included."),
				func(s eventmonitor.Stats) uint64 { return s.Failed }},
			{desc("retries_total", "Handler calls of events that had failed before."),
				func(s eventmonitor.Stats) uint64 { return s.Retried }},
			{desc("events_forgotten_total", "Events removed from their queue by Forget."),
				func(s eventmonitor.Stats) uint64 { return s.Forgotten }},
			{desc("stream_resubscriptions_total", "Subscriptions Run established after an outage: one per outage."),
				func(s eventmonitor.Stats) uint64 { return s.Resubscribed }},
		},
		gauges: []statGauge{
			{desc("handlers_in_flight", "Handler calls running now."),
				func(s eventmonitor.Stats) int { return s.InFlight }},
			{desc("handlers_overrunning", "Handler calls running past their timeout; each holds its key."),
				func(s eventmonitor.Stats) int { return s.Overrunning }},
			{desc("events_queued", "Events waiting for a worker, or behind a call of their key."),
				func(s eventmonitor.Stats) int { return s.Queued }},
			{desc("keys_in_backoff", "Keys waiting for a retry."),
				func(s eventmonitor.Stats) int { return s.KeysInBackoff }},
			{desc("events_in_backoff", "Events held by keys in backoff."),
				func(s eventmonitor.Stats) int { return s.EventsInBackoff }},
		},
	}
	// Every series is scraped from the start, at 0, so rates and alerts
	// see it before its first event.
	for _, r := range reasons {
		c.dropped.WithLabelValues(r.label)
	}
	c.dropped.WithLabelValues(ReasonOther)
	c.handlerDuration.WithLabelValues("success")
	c.handlerDuration.WithLabelValues("error")
	return c
}

// Watch makes scrapes read m's Stats. A Collector watches one monitor; to
// export several, give each its own Collector with WithConstLabels.
func (c *Collector) Watch(m *eventmonitor.Monitor) { c.monitor.Store(m) }

// HandlerDone implements eventmonitor.Metrics.
func (c *Collector) HandlerDone(d time.Duration, err error) {
	result := "success"
	if err != nil {
		result = "error"
	}
	c.handlerDuration.WithLabelValues(result).Observe(d.Seconds())
}

// Recovered implements eventmonitor.Metrics.
func (c *Collector) Recovered(sinceFirstFailure time.Duration) {
	c.recovery.Observe(sinceFirstFailure.Seconds())
}

// Dropped implements eventmonitor.Metrics.
func (c *Collector) Dropped(reason error, events int) {
	c.dropped.WithLabelValues(Reason(reason)).Add(float64(events))
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	c.handlerDuration.Describe(ch)
	c.recovery.Describe(ch)
	c.dropped.Describe(ch)
	for _, sc := range c.counters {
		ch <- sc.desc
	}
	for _, sg := range c.gauges {
		ch <- sg.desc
	}
}

// Collect implements prometheus.Collector. Counters and gauges come from one
// Stats snapshot, so they are consistent with each other.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.handlerDuration.Collect(ch)
	c.recovery.Collect(ch)
	c.dropped.Collect(ch)
	m := c.monitor.Load()
	if m == nil {
		return
	}
	stats := m.Stats()
	for _, sc := range c.counters {
		ch <- prometheus.MustNewConstMetric(sc.desc, prometheus.CounterValue, float64(sc.value(stats)))
	}
	for _, sg := range c.gauges {
		ch <- prometheus.MustNewConstMetric(sg.desc, prometheus.GaugeValue, float64(sg.value(stats)))
	}
}

var (
	_ eventmonitor.Metrics = (*Collector)(nil)
	_ prometheus.Collector = (*Collector)(nil)
)
