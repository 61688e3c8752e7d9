package forwarder_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestMySQLRelaySIGKILL: lock-ordered writers commit events on MariaDB
// while two relay processes publish them to RabbitMQ and are SIGKILLed,
// again and again, and restarted; a consumer with a MariaDB inbox applies
// each event as an effect row. Counted from outside, in the database the
// effects commit to: every committed event applied once (0 lost, 0
// doubled), each key's in its commit order (0 order violations); the
// copies a killed relay had published and not deleted reach the consumer
// again, and its inbox absorbs them.
func TestMySQLRelaySIGKILL(t *testing.T) {
	t.Parallel()
	for _, lockOrdered := range []bool{false, true} {
		t.Run(fmt.Sprintf("LockOrderedWriters=%t", lockOrdered), func(t *testing.T) {
			t.Parallel()
			b := setupMySQL(t, 16)
			store, err := sqlstore.New(b.db, sqlstore.Config{Dialect: sqlstore.MySQL, Schema: b.schema})
			require.NoError(t, err)
			testRelaySIGKILL(t, relayKill{
				db: b.db, schema: b.schema,
				tables: []string{"CREATE TABLE `" + b.name + "`.effects (n BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, " +
					"uuid VARCHAR(64) NOT NULL, `key` VARCHAR(64) NOT NULL, seq INT NOT NULL) ENGINE = InnoDB"},
				inbox: store, inboxTx: sqlstore.Tx,
				// Few lanes per batch, so that a kill often lands between
				// a batch's publish and its commit.
				relay: relayProcess{Driver: "mysql", DSN: mysqltest.Config(t, b.name).FormatDSN(), Dialect: sqlschema.MySQL,
					Schema: b.name, LanesPerBatch: 4, LockOrdered: lockOrdered},
				relays: 2, writerSeed: 11, killSeed: [2]uint64{1, 2},
			})
		})
	}
}
