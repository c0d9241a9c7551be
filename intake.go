package eventmonitor

import (
	"context"
	"errors"
	"fmt"

	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
)

// intakeBatch is how many envelopes stream intake takes off its channel at
// once. It converts them one by one without the monitor's lock, then accepts
// them all under one lock and one worker wake-up: a burst pays for the lock
// and the wake-up once, not per envelope.
const intakeBatch = 128

// maxOrigins bounds the topic and namespace pairs one stream shares trails
// for. containerd has a few dozen topics; anything beyond is allocated.
const maxOrigins = 256

// envelopeIntake turns the envelopes of one stream into accepted events. It
// belongs to the goroutine reading that stream.
type envelopeIntake struct {
	m       *Monitor
	batch   []converted
	origins map[origin]*trail
}

// origin is where an envelope came from.
type origin struct{ topic, namespace string }

// converted is one envelope, converted and waiting to be accepted.
type converted struct {
	env      *Envelope
	key      string
	event    any
	err      error // why it cannot be accepted
	filtered bool  // of another namespace: counted, not accepted
	ignored  bool  // of a type the converter does not key: counted, not accepted
}

// maxIgnoredURLs bounds the type URLs a monitor remembers having ignored, to
// log each once.
const maxIgnoredURLs = 256

func (m *Monitor) newIntake() *envelopeIntake {
	return &envelopeIntake{
		m:       m,
		batch:   make([]converted, 0, intakeBatch),
		origins: make(map[origin]*trail),
	}
}

var errNilEnvelope = fmt.Errorf("%w: nil envelope", ErrInvalidEvent)

// add filters and converts env into the batch.
func (in *envelopeIntake) add(env *Envelope) {
	c := converted{env: env, err: errNilEnvelope}
	if env != nil {
		if ns := in.m.cfg.namespace; ns != "" && env.Namespace != ns {
			c.filtered = true
		} else {
			c.key, c.event, c.err = in.m.convert(env.Event)
			c.ignored = errors.Is(c.err, ErrUnsupportedEvent)
		}
	}
	in.batch = append(in.batch, c)
}

// fill adds what ch already holds, without waiting, until the batch is full.
// It reports false if ch is closed.
func (in *envelopeIntake) fill(ch <-chan *Envelope) bool {
	for len(in.batch) < intakeBatch {
		select {
		case env, ok := <-ch:
			if !ok {
				return false
			}
			in.add(env)
		default:
			return true
		}
	}
	return true
}

// flush accepts the batch, waiting while the intake limit is reached, and
// hands what cannot be accepted to the drop handler with the reason.
func (in *envelopeIntake) flush(ctx context.Context) {
	m := in.m
	var refused, newlyIgnored []converted
	var drops []Drop
	m.mu.Lock()
	for _, c := range in.batch {
		if c.filtered {
			m.stats.Received++
			m.stats.Filtered++
			continue
		}
		if c.ignored {
			m.stats.Received++
			m.stats.Ignored++
			if m.firstIgnored(c.env.Event.GetTypeUrl()) {
				newlyIgnored = append(newlyIgnored, c)
			}
			continue
		}
		if c.err == nil {
			for m.state == stateRunning && ctx.Err() == nil && m.queued-m.eventsInBackoff >= m.cfg.intakeLimit {
				m.waitProgress()
			}
			var k *keyState
			if k, c.err = m.accept(c.key, item{event: c.event, trail: in.trail(c.env)}); c.err == nil {
				m.schedule(k)
				continue
			}
		}
		refused = append(refused, c)
		d := m.refuseLocked(c.key, c.event, c.err)
		if c.env != nil {
			d.Topic, d.Namespace = c.env.Topic, c.env.Namespace
		}
		drops = append(drops, d)
	}
	clear(in.batch) // let the GC have the envelopes; refused and newlyIgnored hold copies
	in.batch = in.batch[:0]
	if len(refused) == 0 && len(newlyIgnored) == 0 {
		m.doneIntake()
		m.mu.Unlock()
		return
	}
	m.mu.Unlock()
	for _, c := range newlyIgnored {
		m.cfg.logger.WithFields(log.Fields{"topic": c.env.Topic, "namespace": c.env.Namespace,
			"type": c.env.Event.GetTypeUrl()}).WithError(c.err).
			Debug("ignoring events of a type the converter has no key for; logged once per type")
	}
	for i, c := range refused {
		if c.env != nil {
			m.cfg.logger.WithFields(log.Fields{"topic": c.env.Topic, "namespace": c.env.Namespace, "key": c.key}).
				WithError(c.err).Debug("envelope dropped")
		}
		m.emit(drops[i])
	}
	m.mu.Lock()
	m.doneIntake()
	m.mu.Unlock()
}

// doneIntake ends a batch's intake, once everything it asked of the drop
// handler and the log is done. mu is held.
func (m *Monitor) doneIntake() {
	if m.intaking.Add(-1) == 0 {
		m.signalProgress()
	}
}

// firstIgnored reports whether url is ignored for the first time, up to
// maxIgnoredURLs. mu is held.
func (m *Monitor) firstIgnored(url string) bool {
	if m.ignoredURLs[url] || len(m.ignoredURLs) >= maxIgnoredURLs {
		return false
	}
	if m.ignoredURLs == nil {
		m.ignoredURLs = make(map[string]bool)
	}
	m.ignoredURLs[url] = true
	return true
}

// trail returns a trail naming env's topic and namespace, shared by every
// event of the same origin until one fails: the common case costs no
// allocation.
func (in *envelopeIntake) trail(env *Envelope) *trail {
	o := origin{env.Topic, env.Namespace}
	if t, ok := in.origins[o]; ok {
		return t
	}
	t := &trail{topic: o.topic, namespace: o.namespace, shared: true}
	if len(in.origins) < maxOrigins {
		in.origins[o] = t
	}
	return t
}

// convert runs the converter, turning a panic (say, in a key function) into
// ErrInvalidEvent.
func (m *Monitor) convert(payload typeurl.Any) (key string, event any, err error) {
	defer func() {
		if r := recover(); r != nil {
			key, event, err = "", nil, fmt.Errorf("%w: converter panicked: %v", ErrInvalidEvent, r)
		}
	}()
	if payload == nil {
		return "", nil, fmt.Errorf("%w: nil payload", ErrInvalidEvent)
	}
	key, event, err = m.cfg.converter.Convert(payload)
	if err == nil && event == nil {
		err = errors.New("converter returned a nil event")
	}
	return key, event, err
}
