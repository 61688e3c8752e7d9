// Package chaos is oncemill's chaos suite; it has no API.
//
// Its tests (build tag chaos, run by make chaos) check the invariant from
// outside, in the database, while real processes die under a steady
// stream with duplicates and poison messages.
//
// TestChaos starts a private PostgreSQL server, a private RabbitMQ node,
// a private Redis and an embedded Kafka broker in a process of its own,
// runs two consumer processes per broker (Kafka, RabbitMQ with a single
// active consumer, SQS) on a PostgreSQL inbox — one with the PostgreSQL
// store, one with the two-tier store — and meanwhile SIGKILLs consumers at random, restarts
// PostgreSQL, restarts RabbitMQ's application and stops Redis.
//
// TestChaosNATS does the same on NATS JetStream, with a private
// nats-server process and an embedded server in the test's process, two
// consumer processes on each: it SIGKILLs consumers at random, restarts
// both NATS servers on their ports and stores, restarts PostgreSQL and
// SIGKILLs the nats-server process.
//
// TestChaosBatchHandler runs the consumers with the inbox's group commit
// and a middleware.BatchHandler that writes a batch's effects with one
// multi-row INSERT, on Kafka and RabbitMQ, two consumer processes each,
// under SIGKILLs, a PostgreSQL restart and a RabbitMQ restart.
//
// At the end each checks from the database that every key was applied
// exactly once or dead-lettered, never both and never neither, that only
// the poison messages were dead-lettered and that every broker holds
// nothing unacknowledged, and it prints, per broker and fault, what was
// sent, applied, doubled, lost and dead-lettered, how many keys applied
// after a later key of their account (the partition key, 16 accounts a
// lane), and the longest stall. Where the setup orders an account across
// processes (Kafka's partitions, RabbitMQ's single active consumer) that
// count must be 0: the consumers keep per-key order while a message
// waits, parked or not.
package chaos
