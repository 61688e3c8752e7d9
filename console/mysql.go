package console

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// mysqlData is what the console reads on MySQL 8.0+ or MariaDB 10.6+
// (Config.DB): the same queries as data.go's, in MySQL's dialect, on the
// tables of sqlschema/mysql. Times come out of the server as microseconds
// since the epoch ({US}) and go in the same way ({AT}), so neither the
// session's time zone nor the DSN's parseTime matters; the binary columns
// (topic, consumer, uuid, key) are compared byte for byte.
type mysqlData struct {
	db     *sql.DB
	names  sqlschema.Names
	schema sqlschema.Config
	r      *strings.Replacer
}

func newMySQLData(db *sql.DB, schema sqlschema.Config) *mysqlData {
	names := sqlschema.NamesFor(sqlschema.MySQL, schema)
	return &mysqlData{db: db, names: names, schema: schema, r: strings.NewReplacer(
		"{T}", names.DLQ, "{I}", names.Inbox,
		"{US}", "TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', ",
		"{AT}", "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP'1970-01-01 00:00:00')")}
}

func fromMicros(n int64) time.Time { return time.UnixMicro(n).UTC() }

func microsPtr(n sql.NullInt64) *time.Time {
	if !n.Valid {
		return nil
	}
	t := fromMicros(n.Int64)
	return &t
}

// normalizeMySQL is normalizeSQL for MySQL and MariaDB: REGEXP_REPLACE
// replaces every match (ICU on MySQL, PCRE on MariaDB, both leftmost-first
// like RE2, which the patterns make agree with leftmost-longest), on the
// column's binary collation, so that the classes keep their case.
func normalizeMySQL(col string) string {
	expr := `LEFT(` + col + `, ` + strconv.Itoa(groupInput) + `)`
	for _, n := range normalizers {
		expr = `REGEXP_REPLACE(` + expr + `, '` + n.pattern + `', '` + n.repl + `')`
	}
	return `COALESCE(NULLIF(LEFT(TRIM(BOTH ' ' FROM ` + expr + `), ` + strconv.Itoa(groupMax) + `), ''), '` + emptyGroup + `')`
}

// where renders cr as a WHERE clause and its arguments.
func (m *mysqlData) where(cr criteria) (string, []any) {
	var (
		conds []string
		args  []any
	)
	if len(cr.IDs) > 0 {
		conds = append(conds, "id IN ("+strings.TrimSuffix(strings.Repeat("?, ", len(cr.IDs)), ", ")+")")
		for _, id := range cr.IDs {
			args = append(args, id)
		}
	}
	// Strings are cleaned as dlq's publisher cleans what it stores.
	if cr.Topic != "" {
		conds, args = append(conds, "topic = ?"), append(args, []byte(clean(cr.Topic)))
	}
	if cr.Consumer != "" {
		conds, args = append(conds, "consumer = ?"), append(args, []byte(clean(cr.Consumer)))
	}
	if cr.Error != "" {
		conds, args = append(conds, "LOCATE(LOWER(?), LOWER(`error`)) > 0"), append(args, clean(cr.Error))
	}
	if cr.Group != "" {
		conds, args = append(conds, normalizeMySQL("`error`")+" = ?"), append(args, clean(cr.Group))
	}
	if !cr.Since.IsZero() {
		conds, args = append(conds, m.r.Replace("dead_at >= {AT}")), append(args, cr.Since.UnixMicro())
	}
	if !cr.Until.IsZero() {
		conds, args = append(conds, m.r.Replace("dead_at <= {AT}")), append(args, cr.Until.UnixMicro())
	}
	if len(conds) == 0 {
		return "", nil
	}
	return " WHERE " + strings.Join(conds, " AND "), args
}

func (m *mysqlData) countDead(ctx context.Context, cr criteria) (int, error) {
	where, args := m.where(cr)
	var n int
	if err := m.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+m.names.DLQ+where, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("console: count dead letters: %w", err)
	}
	return n, nil
}

func (m *mysqlData) listDead(ctx context.Context, cr criteria, limit, offset int) ([]listRow, error) {
	where, args := m.where(cr)
	q := m.r.Replace("SELECT id, uuid, topic, consumer, `key`, attempts, LEFT(`error`, "+strconv.Itoa(maxErrorListed)+"),\n"+
		"    CHAR_LENGTH(`error`) > "+strconv.Itoa(maxErrorListed)+", permanent, {US}dead_at), replay_requested_at IS NOT NULL, LENGTH(payload),\n"+
		"    COALESCE(JSON_UNQUOTE(JSON_EXTRACT(metadata, '$."+delivery.DeadAttemptsSource+"')), ''),\n"+
		"    COALESCE(JSON_UNQUOTE(JSON_EXTRACT(metadata, '$."+delivery.DeadStream+"')), '')\n"+
		"FROM {T}") + where + " ORDER BY id DESC LIMIT ? OFFSET ?"
	rows, err := m.db.QueryContext(ctx, q, append(args, limit, offset)...)
	if err != nil {
		return nil, fmt.Errorf("console: list dead letters: %w", err)
	}
	defer rows.Close()
	var list []listRow
	for rows.Next() {
		var (
			l                          listRow
			uuid, topic, consumer, key []byte
			source, stream             string
			dead                       int64
		)
		if err := rows.Scan(&l.ID, &uuid, &topic, &consumer, &key, &l.Attempts, &l.Error, &l.ErrorTruncated,
			&l.Permanent, &dead, &l.ReplayRequested, &l.PayloadSize, &source, &stream); err != nil {
			return nil, fmt.Errorf("console: list dead letters: %w", err)
		}
		l.Counted = counted(l.Attempts, source, stream)
		l.UUID, l.Topic, l.Consumer, l.Key, l.DeadAt = string(uuid), string(topic), string(consumer), string(key), fromMicros(dead)
		list = append(list, l)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("console: list dead letters: %w", err)
	}
	return list, nil
}

func (m *mysqlData) groups(ctx context.Context, cr criteria, limit int) ([]group, error) {
	where, args := m.where(cr)
	q := m.r.Replace("SELECT g, COUNT(*), {US}MIN(dead_at)), {US}MAX(dead_at)), COUNT(DISTINCT consumer), MIN(consumer),\n" +
		"    COUNT(DISTINCT topic), MIN(topic), COUNT(*) OVER ()\n" +
		"FROM (SELECT " + normalizeMySQL("`error`") + " AS g, dead_at, consumer, topic FROM {T}" + where + ") s\n" +
		"GROUP BY g ORDER BY COUNT(*) DESC, g LIMIT ?")
	rows, err := m.db.QueryContext(ctx, q, append(args, limit)...)
	if err != nil {
		return nil, fmt.Errorf("console: group dead letters: %w", err)
	}
	defer rows.Close()
	var groups []group
	for rows.Next() {
		var (
			g               group
			first, last     int64
			consumer, topic []byte
		)
		if err := rows.Scan(&g.Text, &g.Entries, &first, &last, &g.Consumers, &consumer, &g.Topics, &topic, &g.GroupsInTotal); err != nil {
			return nil, fmt.Errorf("console: group dead letters: %w", err)
		}
		g.First, g.Last, g.Consumer, g.Topic = fromMicros(first), fromMicros(last), string(consumer), string(topic)
		groups = append(groups, g)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("console: group dead letters: %w", err)
	}
	return groups, nil
}

func (m *mysqlData) getEntry(ctx context.Context, id int64, maxPayload int) (entryRow, error) {
	var (
		e                                        entryRow
		uuid, topic, dlqTopic, consumer, key, md []byte
		first, last, offset, requested           sql.NullInt64
		partition                                sql.NullInt32
		dead                                     int64
	)
	err := m.db.QueryRowContext(ctx, m.r.Replace("SELECT id, uuid, topic, dlq_topic, consumer, `key`, attempts,\n"+
		"    LEFT(`error`, "+strconv.Itoa(maxErrorShown)+"), CHAR_LENGTH(`error`) > "+strconv.Itoa(maxErrorShown)+", permanent,\n"+
		"    {US}first_failed_at), {US}last_failed_at), kafka_partition, kafka_offset,\n"+
		"    SUBSTRING(payload, 1, ?), LENGTH(payload), metadata, {US}dead_at), {US}replay_requested_at)\n"+
		"FROM {T} WHERE id = ?"), maxPayload, id).Scan(
		&e.ID, &uuid, &topic, &dlqTopic, &consumer, &key, &e.Attempts, &e.Error, &e.ErrorIsTruncated, &e.Permanent,
		&first, &last, &partition, &offset, &e.Payload, &e.PayloadSize, &md, &dead, &requested)
	if errors.Is(err, sql.ErrNoRows) {
		return entryRow{}, errNoEntry
	}
	if err != nil {
		return entryRow{}, fmt.Errorf("console: read dead letter %d: %w", id, err)
	}
	e.UUID, e.Topic, e.DLQTopic, e.Consumer, e.Key = string(uuid), string(topic), string(dlqTopic), string(consumer), string(key)
	e.FirstFailedAt, e.LastFailedAt, e.ReplayRequestedAt = microsPtr(first), microsPtr(last), microsPtr(requested)
	if partition.Valid {
		e.Partition = &partition.Int32
	}
	if offset.Valid {
		e.Offset = &offset.Int64
	}
	e.DeadAt = fromMicros(dead)
	if err := json.Unmarshal(md, &e.Metadata); err != nil {
		return entryRow{}, fmt.Errorf("console: dead letter %d: metadata: %w", id, err)
	}
	return e, nil
}

func (m *mysqlData) targets(ctx context.Context, cr criteria, limit int) ([]target, error) {
	where, args := m.where(cr)
	rows, err := m.db.QueryContext(ctx, `SELECT id, consumer, topic, replay_requested_at IS NOT NULL FROM `+m.names.DLQ+where+
		` ORDER BY id LIMIT ?`, append(args, limit)...)
	if err != nil {
		return nil, fmt.Errorf("console: select dead letters: %w", err)
	}
	defer rows.Close()
	var ts []target
	for rows.Next() {
		var (
			t               target
			consumer, topic []byte
		)
		if err := rows.Scan(&t.ID, &consumer, &topic, &t.ReplayRequested); err != nil {
			return nil, fmt.Errorf("console: select dead letters: %w", err)
		}
		t.Consumer, t.Topic = string(consumer), string(topic)
		ts = append(ts, t)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("console: select dead letters: %w", err)
	}
	return ts, nil
}

func (m *mysqlData) inboxStats(ctx context.Context, now time.Time) ([]inboxStat, error) {
	rows, err := m.db.QueryContext(ctx, m.r.Replace("SELECT consumer,\n"+
		"    COALESCE(SUM(status = 'done' AND done_at >= {AT}), 0),\n"+
		"    COALESCE(SUM(status = 'done' AND done_at >= {AT}), 0),\n"+
		"    COALESCE(SUM(status = 'processing'), 0),\n"+
		"    COALESCE(SUM(status = 'failed'), 0),\n"+
		"    COALESCE(SUM(status = 'dead'), 0),\n"+
		"    COALESCE(SUM(dead_copies), 0)\n"+
		"FROM {I} GROUP BY consumer ORDER BY consumer"), now.Add(-time.Hour).UnixMicro(), now.Add(-24*time.Hour).UnixMicro())
	if err != nil {
		return nil, fmt.Errorf("console: inbox by consumer: %w", err)
	}
	defer rows.Close()
	var stats []inboxStat
	for rows.Next() {
		var (
			s        inboxStat
			consumer []byte
		)
		if err := rows.Scan(&consumer, &s.LastHour, &s.LastDay, &s.Processing, &s.Failing, &s.Dead, &s.DeadCopies); err != nil {
			return nil, fmt.Errorf("console: inbox by consumer: %w", err)
		}
		s.Consumer = string(consumer)
		stats = append(stats, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("console: inbox by consumer: %w", err)
	}
	return stats, nil
}

// consumers walks the inbox's primary key: DISTINCT on its first column
// is a loose index scan.
func (m *mysqlData) consumers(ctx context.Context) ([]string, error) {
	rows, err := m.db.QueryContext(ctx, `SELECT DISTINCT consumer FROM `+m.names.Inbox+` ORDER BY consumer LIMIT ?`, maxConsumers)
	if err != nil {
		return nil, fmt.Errorf("console: inbox consumers: %w", err)
	}
	defer rows.Close()
	var names []string
	for rows.Next() {
		var consumer []byte
		if err := rows.Scan(&consumer); err != nil {
			return nil, fmt.Errorf("console: inbox consumers: %w", err)
		}
		names = append(names, string(consumer))
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("console: inbox consumers: %w", err)
	}
	return names, nil
}

// The sizes of the MySQL inbox table's key columns (sqlschema/mysql/
// 001_inbox.up.sql): a longer consumer or key is stored as its SHA-256
// digest, as the inbox store stores it.
const (
	mysqlInboxMaxConsumer = 255
	mysqlInboxMaxKey      = 1024
)

func inboxStored(s string, max int) string {
	if len(s) <= max {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func (m *mysqlData) lookupKey(ctx context.Context, consumer, key string, maxPayload int) (inboxRow, error) {
	var (
		k                              inboxRow
		first, last, done, dead, lease sql.NullInt64
		created, updated, expires      int64
		resultSize                     sql.NullInt64
	)
	err := m.db.QueryRowContext(ctx, m.r.Replace("SELECT status, attempts,\n"+
		"    LEFT(COALESCE(first_error, ''), ?), LEFT(COALESCE(last_error, ''), ?), {US}first_failed_at), {US}last_failed_at),\n"+
		"    SUBSTRING(result, 1, ?), LENGTH(result), {US}created_at), {US}updated_at), {US}done_at), {US}dead_at),\n"+
		"    {US}lease_until), {US}expires_at), dead_copies\n"+
		"FROM {I} WHERE consumer = ? AND `key` = ?"),
		maxErrorShown, maxErrorShown, maxPayload,
		[]byte(inboxStored(clean(consumer), mysqlInboxMaxConsumer)), []byte(inboxStored(clean(key), mysqlInboxMaxKey))).Scan(
		&k.Status, &k.Attempts, &k.FirstError, &k.LastError, &first, &last,
		&k.Result, &resultSize, &created, &updated, &done, &dead, &lease, &expires, &k.DeadCopies)
	if errors.Is(err, sql.ErrNoRows) {
		return inboxRow{}, errNoKey
	}
	if err != nil {
		return inboxRow{}, fmt.Errorf("console: look up key: %w", err)
	}
	k.FirstFailedAt, k.LastFailedAt = microsPtr(first), microsPtr(last)
	k.DoneAt, k.DeadAt, k.LeaseUntil = microsPtr(done), microsPtr(dead), microsPtr(lease)
	k.CreatedAt, k.UpdatedAt, k.ExpiresAt = fromMicros(created), fromMicros(updated), fromMicros(expires)
	if resultSize.Valid {
		n := int(resultSize.Int64)
		k.ResultSize = &n
	}
	return k, nil
}

func (m *mysqlData) outboxLag(ctx context.Context) (forwarder.Lag, error) {
	return forwarder.SQLOutboxLag(ctx, m.db, sqlschema.MySQL, m.schema)
}
