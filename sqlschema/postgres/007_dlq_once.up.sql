-- One entry per message and consumer: dlq.Publisher writes a dead letter
-- only if the table has no entry yet for the same consumer, original topic
-- and message UUID (other than one whose replay was requested, which is
-- on its way back to the consumer and goes once it is handled). A message
-- whose ack was lost after it was dead-lettered (a crash, a rebalance) is
-- delivered again and dead-lettered again; without a key the inbox cannot
-- tell, and the table would hold it twice, and a replay would send it
-- twice. This index serves that check.
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_uuid_idx" ON {{.DLQ}} (consumer, uuid);
