package adapters_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestLinksOnlyImportedBrokers checks the promise of one broker per
// import from the outside, on programs built by the go command: a
// program that imports adapters and adapters/amqp depends on no package
// of another broker's client or of an embedded broker, and Open tells
// such a program which import a scheme it does not link needs; a Kafka
// program without adapters/kafka/embedded is told to import it for
// kafka:// with no host.
func TestLinksOnlyImportedBrokers(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	deps, err := exec.CommandContext(ctx, "go", "list", "-deps", "./testdata/amqponly").Output()
	require.NoError(t, err)
	require.Contains(t, string(deps), "github.com/rabbitmq/amqp091-go\n", "the RabbitMQ client is linked")
	for _, pkg := range strings.Fields(string(deps)) {
		for _, other := range []string{
			"github.com/IBM/sarama", "github.com/twmb/franz-go", "github.com/aws/",
			"github.com/nats-io/", "github.com/ThreeDotsLabs/watermill-kafka", "github.com/ThreeDotsLabs/watermill-nats",
		} {
			require.False(t, strings.HasPrefix(pkg, other), "a RabbitMQ program links %s", pkg)
		}
	}

	out, err := exec.CommandContext(ctx, "go", "run", "./testdata/amqponly",
		"kafka://127.0.0.1:9092?group=g", "sqs://us-east-1", "nats://127.0.0.1:4222?group=g", "amqp://guest:guest@127.0.0.1:1/?connect_timeout=1").CombinedOutput()
	require.NoError(t, err, "%s", out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, 4, "%s", out)
	for i, pkg := range []string{"kafka", "sqs", "nats"} {
		require.Contains(t, lines[i], "broker package not linked", lines[i])
		require.Contains(t, lines[i], `import _ "github.com/oncemill/oncemill/adapters/`+pkg+`"`, lines[i])
	}
	require.NotContains(t, lines[3], "not linked", "amqp:// is linked: it fails on the closed port, not on the import")

	out, err = exec.CommandContext(ctx, "go", "run", "./testdata/kafkaonly").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "broker package not linked", "%s", out)
	require.Contains(t, string(out), `import _ "github.com/oncemill/oncemill/adapters/kafka/embedded"`, "%s", out)
}
