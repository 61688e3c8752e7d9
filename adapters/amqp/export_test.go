package amqp

// DropConnections closes the connections of the subscriber's
// subscriptions under them, as a broker or a network that drops them
// would: the subscriptions connect again.
func DropConnections(s *Subscriber) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for conn := range s.conns {
		_ = conn.Close()
	}
}
