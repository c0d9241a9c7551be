package fakecontainerd

import (
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/containerd/api/types"
	"github.com/containerd/typeurl/v2"
)

// containerd's filter syntax: selectors joined by commas, each a dotted
// field path, then optionally an operator and a value. A field or value may
// be quoted with ", / or |, so that `topic~=/tasks/` is the regexp "tasks".
const (
	quotedRE = `"(?:[^"\\]|\\.)*"|/(?:[^/\\]|\\.)*/|\|(?:[^|\\]|\\.)*\|`
	fieldRE  = `(?:[A-Za-z0-9_]+|` + quotedRE + `)`
)

var (
	selectorRE = regexp.MustCompile(`^ *(` + fieldRE + `(?:\.` + fieldRE + `)*) *(?:(==|!=|~=) *(` + quotedRE + `|[^\s,"/|][^\s,]*))? *(,|$)`)
	fieldsRE   = regexp.MustCompile(fieldRE)
)

type selector struct {
	path      []string
	op, value string // op "" tests presence
	re        *regexp.Regexp
}

// filter selects what matches every selector of any one of its filters,
// and everything if it has none.
type filter [][]selector

func parseFilters(ss []string) (filter, error) {
	var f filter
	for _, s := range ss {
		var all []selector
		for rest := s; strings.TrimSpace(rest) != ""; {
			m := selectorRE.FindStringSubmatch(rest)
			if m == nil || m[4] == "," && strings.TrimSpace(rest[len(m[0]):]) == "" {
				return nil, fmt.Errorf("filter %q: parse error at %q", s, rest)
			}
			sel := selector{op: m[2], value: unquote(m[3])}
			for _, field := range fieldsRE.FindAllString(m[1], -1) {
				sel.path = append(sel.path, unquote(field))
			}
			if sel.op == "~=" {
				var err error
				if sel.re, err = regexp.Compile(sel.value); err != nil {
					return nil, fmt.Errorf("filter %q: %w", s, err)
				}
			}
			all, rest = append(all, sel), rest[len(m[0]):]
		}
		f = append(f, all) // an empty filter matches everything, as containerd's
	}
	return f, nil
}

// unquote strips a quoted token's quotes; a /…/ or |…| one keeps its
// escapes but the delimiter's, being a regexp.
func unquote(tok string) string {
	if tok == "" || !strings.ContainsRune(`"/|`, rune(tok[0])) {
		return tok
	}
	if tok[0] == '"' {
		s, _ := strconv.Unquote(tok) // the syntax is Go's, bar a few escapes
		return s
	}
	return strings.ReplaceAll(tok[1:len(tok)-1], `\`+tok[:1], tok[:1])
}

// adaptor reads an object's field by its path, as containerd's
// filters.Adaptor does; false when the object has no such field.
type adaptor func(path []string) (string, bool)

func (f filter) match(field adaptor) bool {
	if len(f) == 0 {
		return true
	}
	for _, all := range f {
		if !slices.ContainsFunc(all, func(s selector) bool { return !s.match(field) }) {
			return true
		}
	}
	return false
}

func (s selector) match(field adaptor) bool {
	v, ok := field(s.path)
	switch s.op {
	case "":
		return ok
	case "==":
		return ok && v == s.value
	case "!=":
		return v != s.value // containerd's: an absent field differs
	}
	return s.re.MatchString(v)
}

// envelopeFields is an envelope's adaptor, as containerd's: namespace,
// topic, and event.<field> of the decoded payload.
func envelopeFields(env *types.Envelope) adaptor {
	return func(path []string) (string, bool) {
		switch path[0] {
		case "namespace":
			return env.GetNamespace(), env.GetNamespace() != ""
		case "topic":
			return env.GetTopic(), env.GetTopic() != ""
		case "event":
			if env.GetEvent() == nil {
				return "", false
			}
			ev, err := typeurl.UnmarshalAny(env.GetEvent())
			if fields, ok := ev.(interface{ Field([]string) (string, bool) }); err == nil && ok {
				return fields.Field(path[1:])
			}
		}
		return "", false
	}
}
