// Command bound measures the server-side bound of the inbox's new-key
// paths: the statements the inbox sends for a new key, replayed by the
// database's own load tool with no Go client in the way (pgbench on
// PostgreSQL, mariadb-slap or mysqlslap on MariaDB and MySQL), against the
// hand-written SQL they are compared with in bench-dedup and bench-kafka,
// at the same number of clients, alternating, in the same run. A ratio
// here is what the statements allow; a Go row's ratio beside it says what
// the client adds.
//
// Scripts, each one message:
//
//   - raw: BEGIN; INSERT INTO raw_keys … ON CONFLICT DO NOTHING (INSERT
//     IGNORE); the effect; COMMIT — bench-dedup's raw-sql, a round trip
//     each;
//   - default: the attempt record committed on its own, then BEGIN, the
//     claim that also clears the record, the effect, COMMIT — the default
//     inbox where the broker counts nothing and no hand-out mark covers
//     the delivery;
//   - unstarted: BEGIN, the claim, the effect, COMMIT — a first delivery
//     the broker counts, or one below a Kafka hand-out mark;
//   - no-inbox: the effect alone, INSERT … ON CONFLICT DO NOTHING (INSERT
//     IGNORE) on a keyed table, committed on its own — bench-kafka's
//     no-inbox consumer.
//
// On PostgreSQL, default and unstarted send their first statements in one
// pipeline, as the inbox does through pgx: the start, BEGIN and the claim;
// BEGIN and the claim. On MariaDB each statement is a round trip, as
// through database/sql.
//
// The statements of default and unstarted come from the inbox's own
// rendering (sqldb.Dialect.NewKeyPaths), so the bound follows the code.
// Each key is new: random over 10^12 on PostgreSQL, UUID() on MariaDB.
//
//	cd benchmarks && go run ./bound                  # PostgreSQL and MariaDB, 8 clients, 3 rounds of 10 s
//	cd benchmarks && go run ./bound -dbs postgres -seconds 5 -rounds 2
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// schema holds the run's tables, dropped before and after.
const schema = "oncemill_bound"

// scripts are the scripts' names, in the order they run in each round.
var scripts = []string{"raw", "default", "unstarted", "no-inbox"}

// script is one message's statements: key is set by the tool's first line.
type script struct {
	name  string
	lines []string
}

func main() {
	var (
		dsn      = flag.String("dsn", benchutil.EnvOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (default $DATABASE_URL)")
		mysqlDSN = flag.String("mysql", benchutil.EnvOr("MYSQL_URL", "root@tcp(127.0.0.1:3306)/test"), "MariaDB or MySQL DSN, go-sql-driver/mysql's form (default $MYSQL_URL)")
		dbs      = flag.String("dbs", "postgres,mysql", "databases to measure: postgres, mysql")
		clients  = flag.Int("clients", 8, "clients of the load tool, as bench-dedup's workers")
		seconds  = flag.Int("seconds", 10, "seconds of each script's run on PostgreSQL")
		messages = flag.Int("messages", 24000, "messages of each script's run on MariaDB (its tool counts statements, not time)")
		rounds   = flag.Int("rounds", 3, "rounds; a script's figure is its median")
	)
	flag.Parse()
	ctx := context.Background()
	for _, db := range strings.Split(*dbs, ",") {
		var (
			rates map[string][]float64
			err   error
		)
		switch db {
		case "postgres":
			rates, err = postgres(ctx, *dsn, *clients, *seconds, *rounds)
		case "mysql":
			rates, err = mariadb(ctx, *mysqlDSN, *clients, *messages, *rounds)
		default:
			err = fmt.Errorf("-dbs: unknown database %q; use postgres or mysql", db)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "bound: %s: %v\n", db, err)
			os.Exit(1)
		}
		report(db, *clients, rates)
	}
}

// report prints the medians and the ratios the benchmarks' targets use.
func report(db string, clients int, rates map[string][]float64) {
	med := map[string]float64{}
	fmt.Printf("\n%s, %d clients, messages/s (median of %d rounds; each round's figure in brackets)\n\n", db, clients, len(rates["raw"]))
	fmt.Println("| script | msgs/s | rounds |")
	fmt.Println("|---|---:|---|")
	for _, s := range scripts {
		r := slices.Clone(rates[s])
		slices.Sort(r)
		med[s] = r[len(r)/2]
		fmt.Printf("| %s | %.0f | %s |\n", s, med[s], join(rates[s]))
	}
	fmt.Printf("\n| ratio | bound |\n|---|---:|\n")
	fmt.Printf("| default / raw (bench-dedup's default row) | %.2f× |\n", med["default"]/med["raw"])
	fmt.Printf("| unstarted / raw (broker-counted, marked) | %.2f× |\n", med["unstarted"]/med["raw"])
	fmt.Printf("| unstarted / no-inbox (bench-kafka's per-message row) | %.2f× |\n", med["unstarted"]/med["no-inbox"])
	fmt.Printf("| raw / no-inbox (hand-written exactly-once, the same comparison) | %.2f× |\n", med["raw"]/med["no-inbox"])
}

func join(fs []float64) string {
	s := make([]string, len(fs))
	for i, f := range fs {
		s[i] = strconv.FormatFloat(f, 'f', 0, 64)
	}
	return strings.Join(s, ", ")
}

// messageScripts renders the four scripts on the dialect d, key being the
// SQL text of the message's key. pipeline brackets what the inbox sends in
// one round trip through pgx (the start, BEGIN and the claim; BEGIN and the
// claim) in pgbench's pipeline commands, as the Go client sends them.
func messageScripts(d *sqldb.Dialect, names sqlschema.Names, key, ignore, onConflict string, pipeline bool) map[string]script {
	lit := func(param string) string {
		switch param {
		case "consumer":
			return "'bound'"
		case "key":
			return key
		}
		return "3600000000"
	}
	started, unstarted := d.NewKeyPaths(names, lit)
	k := d.Quote("key")
	effect := "INSERT INTO " + schema + ".effects (" + k + ", payload) VALUES (" + key + ", 'payload');"
	lines := func(stmts []string) []string {
		out := make([]string, len(stmts))
		for i, s := range stmts {
			out[i] = oneLine(s) + ";"
		}
		return out
	}
	// tx is a message's statements: start, then BEGIN and claim, piped
	// together where pipe says, then the effect and COMMIT.
	tx := func(pipe bool, start, claim []string) []string {
		out := slices.Concat(lines(start), []string{"BEGIN;"}, lines(claim))
		if pipe {
			out = slices.Concat([]string{`\startpipeline`}, out, []string{`\endpipeline`})
		}
		return append(out, effect, "COMMIT;")
	}
	return map[string]script{
		"raw":       {"raw", tx(false, nil, []string{"INSERT " + ignore + "INTO " + schema + ".raw_keys (" + k + ") VALUES (" + key + ")" + onConflict})},
		"default":   {"default", tx(pipeline, started.Start, started.Claim)},
		"unstarted": {"unstarted", tx(pipeline, nil, unstarted.Claim)},
		"no-inbox":  {"no-inbox", []string{"INSERT " + ignore + "INTO " + schema + ".keyed_effects (" + k + ", payload) VALUES (" + key + ", 'payload')" + onConflict + ";"}},
	}
}

// oneLine puts s on one line: both tools read a statement per line.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func postgres(ctx context.Context, dsn string, clients, seconds, rounds int) (map[string][]float64, error) {
	if _, err := exec.LookPath("pgbench"); err != nil {
		return nil, fmt.Errorf("pgbench is not on PATH (Debian: apt-get install postgresql-client): %w", err)
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	drop := func() error { _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); return err }
	if err := drop(); err != nil {
		return nil, err
	}
	defer drop()
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{Schema: schema}); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+schema+`.effects (key text NOT NULL, payload bytea NOT NULL);
CREATE TABLE `+schema+`.raw_keys (key text PRIMARY KEY);
CREATE TABLE `+schema+`.keyed_effects (key text PRIMARY KEY, payload bytea NOT NULL)`); err != nil {
		return nil, err
	}
	d := sqldb.Postgres
	ss := messageScripts(d, d.Names(sqlschema.Config{Schema: schema}), "('b' || :k)", "", " ON CONFLICT DO NOTHING", true)
	dir, err := os.MkdirTemp("", "bound")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	tps := regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)
	return run(rounds, func(s script) (float64, error) {
		file := filepath.Join(dir, s.name+".sql")
		body := "\\set k random(1, 1000000000000)\n" + strings.Join(s.lines, "\n") + "\n"
		if err := os.WriteFile(file, []byte(body), 0o600); err != nil {
			return 0, err
		}
		out, err := exec.CommandContext(ctx, "pgbench", "-n", "-M", "prepared", "-c", strconv.Itoa(clients),
			"-j", "2", "-T", strconv.Itoa(seconds), "-f", file, dsn).CombinedOutput()
		if err != nil {
			return 0, fmt.Errorf("pgbench %s: %w\n%s", s.name, err, out)
		}
		if strings.Contains(string(out), "aborted") {
			return 0, fmt.Errorf("pgbench %s: a client aborted:\n%s", s.name, out)
		}
		m := tps.FindSubmatch(out)
		if m == nil {
			return 0, fmt.Errorf("pgbench %s: no tps in its output:\n%s", s.name, out)
		}
		return strconv.ParseFloat(string(m[1]), 64)
	}, ss)
}

func mariadb(ctx context.Context, dsn string, clients, messages, rounds int) (map[string][]float64, error) {
	tool, err := exec.LookPath("mariadb-slap")
	if err != nil {
		if tool, err = exec.LookPath("mysqlslap"); err != nil {
			return nil, errors.New("neither mariadb-slap nor mysqlslap is on PATH (Debian: apt-get install mariadb-client)")
		}
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("-mysql: %w", err)
	}
	host, port, err := net.SplitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("-mysql: the address %q: %w", cfg.Addr, err)
	}
	cfg.DBName, cfg.MultiStatements = "", false
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		return nil, err
	}
	defer db.Close()
	drop := func() error { _, err := db.ExecContext(ctx, "DROP DATABASE IF EXISTS "+schema); return err }
	if err := drop(); err != nil {
		return nil, err
	}
	defer drop()
	for _, q := range []string{
		"CREATE DATABASE " + schema,
		"CREATE TABLE " + schema + ".effects (`key` VARBINARY(255) NOT NULL, payload BLOB NOT NULL) ENGINE=InnoDB",
		"CREATE TABLE " + schema + ".raw_keys (`key` VARBINARY(255) PRIMARY KEY) ENGINE=InnoDB",
		"CREATE TABLE " + schema + ".keyed_effects (`key` VARBINARY(255) PRIMARY KEY, payload BLOB NOT NULL) ENGINE=InnoDB",
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return nil, err
		}
	}
	if err := sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, sqlschema.Config{Schema: schema}); err != nil {
		return nil, err
	}
	d := sqldb.MySQL
	ss := messageScripts(d, d.Names(sqlschema.Config{Schema: schema}), "@k", "IGNORE ", "", false)
	secs := regexp.MustCompile(`Average number of seconds to run all queries: ([0-9.]+)`)
	return run(rounds, func(s script) (float64, error) {
		lines := append([]string{"SET @k = UUID();"}, s.lines...)
		// The tool counts statements: whole messages, whole for each client.
		per := len(lines)
		n := messages / clients * clients * per
		args := []string{"--host", host, "--port", port, "--user", cfg.User, "--create-schema", schema,
			"--concurrency", strconv.Itoa(clients), "--iterations", "1", "--number-of-queries", strconv.Itoa(n),
			"--delimiter", ";", "--query", strings.Join(lines, "")}
		if cfg.Passwd != "" {
			args = append(args, "--password="+cfg.Passwd)
		}
		out, err := exec.CommandContext(ctx, tool, args...).CombinedOutput()
		if err != nil {
			return 0, fmt.Errorf("%s %s: %w\n%s", filepath.Base(tool), s.name, err, out)
		}
		m := secs.FindSubmatch(out)
		if m == nil {
			return 0, fmt.Errorf("%s %s: no time in its output:\n%s", filepath.Base(tool), s.name, out)
		}
		t, err := strconv.ParseFloat(string(m[1]), 64)
		if err != nil || t <= 0 {
			return 0, fmt.Errorf("%s %s: time %q", filepath.Base(tool), s.name, m[1])
		}
		return float64(n/per) / t, nil
	}, ss)
}

// run runs each script once a round, in the same order, and returns each
// one's rates.
func run(rounds int, measure func(script) (float64, error), ss map[string]script) (map[string][]float64, error) {
	rates := map[string][]float64{}
	for r := 0; r < rounds; r++ {
		for _, name := range scripts {
			start := time.Now()
			rate, err := measure(ss[name])
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(os.Stderr, "round %d %-9s %6.0f msgs/s (%s)\n", r+1, name, rate, time.Since(start).Round(time.Second))
			rates[name] = append(rates[name], rate)
		}
	}
	return rates, nil
}
