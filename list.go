package eventmonitor

// listLinks are the links an element of a linkedList holds.
type listLinks[T any] struct{ prev, next *T }

// linkedList is a doubly linked list whose elements hold their own links:
// adding and removing cost O(1) and allocate nothing. The monitor keeps its
// calls in flight and its idle keys in such lists.
type linkedList[T any, P interface {
	*T
	links() *listLinks[T]
}] struct {
	head, tail P
	n          int
}

// push appends x, which must not be in a list.
func (l *linkedList[T, P]) push(x P) {
	*x.links() = listLinks[T]{prev: l.tail}
	if l.tail != nil {
		l.tail.links().next = x
	} else {
		l.head = x
	}
	l.tail = x
	l.n++
}

// remove unlinks x, which must be in l.
func (l *linkedList[T, P]) remove(x P) {
	link := x.links()
	if link.prev != nil {
		P(link.prev).links().next = link.next
	} else {
		l.head = link.next
	}
	if link.next != nil {
		P(link.next).links().prev = link.prev
	} else {
		l.tail = link.prev
	}
	*link = listLinks[T]{}
	l.n--
}
