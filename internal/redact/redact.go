// Package redact hides the credentials of a URL or a DSN before it is
// printed, in every form oncemill's users write them: a password in the
// user info (amqp://user:pass@host), a user-only token
// (nats://TOKEN@host), a query parameter (postgres://host/db?password=…,
// sqs://…?endpoint=http://u:p@host, where the nested URL is redacted in
// turn) and a MySQL DSN (user:pass@tcp(host:3306)/db). url.URL.Redacted
// hides only the first.
//
// Query values are shown only for parameters known to hold none (group,
// timeouts, sslmode, …): any other parameter, whether its name looks
// secret (password, token, key, …) or is simply not known, is printed by
// name with its value hidden, so that a misspelt parameter is still
// named in an error and a secret under a new name is still hidden.
//
// Adapters, the command, the console and the relay all print through
// [URL], and scrub what a driver quoted through [Error].
package redact

import (
	"net/url"
	"strings"
)

// Mask replaces a hidden value.
const Mask = "xxxxx"

// shown are the query parameters whose values carry no credential and
// are printed as given: those of oncemill's broker and database URLs.
var shown = map[string]bool{
	// every broker
	"group": true, "connect_timeout": true, "drain_timeout": true,
	// kafka
	"offset": true, "read_timeout": true, "session_timeout": true, "rebalance_timeout": true,
	"max_in_flight": true, "max_in_flight_total": true, "instance_id": true,
	// nats
	"stream": true, "create": true, "duplicate_window": true, "ack_wait": true,
	"max_deliver": true, "max_ack_pending": true,
	// sqs (endpoint is a URL: redacted in turn)
	"endpoint": true, "visibility_timeout": true, "max_messages": true, "region": true,
	// amqp
	"prefetch": true, "delivery_limit": true, "dead_letter_exchange": true, "heartbeat": true,
	"channel_max": true, "auth_mechanism": true, "server_name_indication": true,
	// gochannel
	"persistent": true,
	// postgres
	"host": true, "port": true, "dbname": true, "user": true, "sslmode": true, "ssl": true,
	"sslcertmode": true, "sslnegotiation": true, "sslsni": true, "target_session_attrs": true,
	"min_protocol_version": true, "max_protocol_version": true, "channel_binding": true,
	"statement_cache_capacity": true, "description_cache_capacity": true, "default_query_exec_mode": true,
	"pool_max_conns": true, "pool_min_conns": true, "pool_min_idle_conns": true,
	"pool_max_conn_lifetime": true, "pool_max_conn_idle_time": true, "pool_max_conn_lifetime_jitter": true,
	"pool_health_check_period": true, "pool_ping_timeout": true,
	"application_name": true, "client_encoding": true, "search_path": true, "timezone": true,
	// mysql (go-sql-driver), and the command's own
	"timeout": true, "readTimeout": true, "writeTimeout": true, "parseTime": true, "loc": true,
	"tls": true, "charset": true, "collation": true, "schema": true, "table": true, "prefix": true,
}

// URL returns raw with every credential hidden: the password of the user
// info (the user name stays, as url.URL.Redacted leaves it), a user info
// without a password whole (a token), the value of every query parameter
// not known to be harmless, and the credentials of a URL nested in a
// query value. raw may also be a MySQL DSN (user:pass@tcp(host)/db) or
// text that does not parse as a URL, whose user info, up to its last
// '@', is hidden all the same.
func URL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Opaque != "" || (u.Scheme == "" && u.Host == "") {
		return rawURL(raw)
	}
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), Mask)
		} else {
			u.User = url.User(Mask)
		}
	}
	if u.Fragment != "" {
		// No broker or database URL has a fragment: one is a mistyped
		// query, which may hold a secret.
		u.Fragment, u.RawFragment = Mask, ""
	}
	query := u.RawQuery
	u.RawQuery, u.ForceQuery = "", false
	s := u.String()
	if n := len(u.Scheme); strings.HasPrefix(raw[n:], "://") && !strings.HasPrefix(s[n:], "://") {
		s = s[:n] + "://" + s[n+1:] // kafka:// with no host, as given
	}
	if query != "" {
		if frag := strings.Index(s, "#"); frag >= 0 {
			return s[:frag] + "?" + Query(query) + s[frag:]
		}
		s += "?" + Query(query)
	}
	return s
}

// Query returns a URL's raw query with the value of every parameter not
// known to be harmless hidden, and a URL in a value redacted by [URL];
// the parameters keep their order.
func Query(raw string) string {
	parts := strings.Split(raw, "&")
	for i, p := range parts {
		name, value, hasValue := strings.Cut(p, "=")
		key, err := url.QueryUnescape(name)
		if err != nil {
			parts[i] = Mask
			continue
		}
		if strings.Contains(key, "@") {
			// A name that holds user info is a mistyped URL, not a
			// parameter: "?0://user:pass@host" parses as a query whose
			// first part is named "0://user:pass@host", with or without
			// an "=" after it.
			parts[i] = Mask
			continue
		}
		if !hasValue {
			continue // a flag
		}
		decoded, err := url.QueryUnescape(value)
		switch {
		case err != nil || !shown[key]:
			parts[i] = name + "=" + Mask
		case strings.Contains(decoded, "@") || strings.Contains(decoded, "://"):
			parts[i] = name + "=" + URL(decoded)
		}
	}
	return strings.Join(parts, "&")
}

// rawURL hides the credentials of text that did not parse as a URL with
// a host: the user info before the last '@' of the authority (or of a
// DSN's start, up to "@tcp(" or the like), and the query.
func rawURL(raw string) string {
	if q, sep := strings.Index(raw, "?"), strings.Index(raw, "://"); q >= 0 && sep > q {
		// "?://user:pa&ss@host?…": the '?' belongs to a mistyped scheme,
		// not to a query, and the user info after "://" may hold the
		// '&' that would split it into query parts.
		return raw[:sep+3] + rawURL(raw[sep+3:])
	}
	s, query, hasQuery := strings.Cut(raw, "?")
	prefix, rest := "", s
	if scheme, after, ok := strings.Cut(s, "://"); ok {
		prefix, rest = scheme+"://", after
	} else if scheme, after, ok := strings.Cut(s, ":"); ok && isScheme(scheme) && strings.Contains(after, "@") && !strings.Contains(scheme, "@") {
		// An opaque URL such as mysql:user:pass@tcp(host)/db.
		prefix, rest = scheme+":", after
	}
	// The authority ends at the first '/' after its '@', or at the first
	// '/' when a DSN's address holds one: hide up to the last '@' before
	// the path.
	authority := rest
	if slash := strings.Index(rest, "/"); slash >= 0 && strings.Contains(rest[:slash], "@") {
		authority = rest[:slash]
	}
	if at := strings.LastIndex(authority, "@"); at >= 0 {
		user, _, hasPass := strings.Cut(authority[:at], ":")
		masked := Mask
		if hasPass {
			masked = user + ":" + Mask
		}
		rest = masked + rest[at:]
	}
	out := prefix + rest
	if hasQuery {
		out += "?" + Query(query)
	}
	return out
}

// isScheme reports whether s is spelt as a URL scheme.
func isScheme(s string) bool {
	if s == "" {
		return false
	}
	for i, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z':
		case i > 0 && (r >= '0' && r <= '9' || r == '+' || r == '-' || r == '.'):
		default:
			return false
		}
	}
	return true
}

// Error returns err with raw, and each credential of raw, replaced in its
// text as [URL] replaces them, in case a driver quoted the URL or a part
// of it; it still unwraps to err for errors.Is and errors.As. A password
// is replaced only where it is quoted with what surrounds it in raw (the
// user info with its '@', a parameter with its name), never as bare text,
// which may be a common word or a single letter. Error(nil, raw) is nil.
func Error(err error, raw string) error {
	if err == nil || raw == "" {
		return err
	}
	msg := Text(err.Error(), raw)
	if msg == err.Error() {
		return err
	}
	return redacted{msg: msg, err: err}
}

// Text is what [Error] does to an error's text: s with raw, and each
// credential of raw, replaced.
func Text(s, raw string) string {
	safe := URL(raw)
	if safe == raw {
		return s
	}
	s = strings.ReplaceAll(s, raw, safe)
	for _, f := range secretForms(raw) {
		s = strings.ReplaceAll(s, f[0], f[1])
	}
	return s
}

// secretForms returns the spellings of raw's credentials that a driver
// may quote, each with its replacement: the user info with its '@' (as
// written, re-escaped and decoded) and each hidden query parameter with
// its name (as written and decoded).
func secretForms(raw string) [][2]string {
	var forms [][2]string
	add := func(from, to string) {
		if from != "" && from != to {
			forms = append(forms, [2]string{from, to})
		}
	}
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		masked := url.User(Mask).String() + "@"
		if pass, ok := u.User.Password(); ok {
			masked = url.UserPassword(u.User.Username(), Mask).String() + "@"
			add(u.User.Username()+":"+pass+"@", masked)
		} else {
			add(u.User.Username()+"@", masked)
		}
		add(u.User.String()+"@", masked)
	}
	s, query, _ := strings.Cut(raw, "?")
	if _, rest, ok := strings.Cut(s, "://"); ok {
		s = rest
	}
	if slash := strings.Index(s, "/"); slash >= 0 && strings.Contains(s[:slash], "@") {
		s = s[:slash]
	}
	if at := strings.LastIndex(s, "@"); at >= 0 {
		add(s[:at+1], strings.TrimPrefix(rawURL("x://"+s[:at+1]), "x://"))
	}
	for _, p := range strings.Split(query, "&") {
		name, value, ok := strings.Cut(p, "=")
		if !ok || value == "" {
			continue
		}
		safe := Query(p)
		add(p, safe)
		key, err := url.QueryUnescape(name)
		if err != nil {
			continue
		}
		decoded, err := url.QueryUnescape(value)
		if err != nil {
			continue
		}
		_, safeValue, _ := strings.Cut(safe, "=")
		add(key+"="+decoded, key+"="+safeValue)
		if shown[key] && (strings.Contains(decoded, "@") || strings.Contains(decoded, "://")) {
			// A nested URL: a client quotes it on its own.
			add(decoded, URL(decoded))
			forms = append(forms, secretForms(decoded)...)
		}
	}
	return forms
}

// redacted is an error whose text has the credentials removed; it
// unwraps to the original.
type redacted struct {
	msg string
	err error
}

func (e redacted) Error() string { return e.msg }
func (e redacted) Unwrap() error { return e.err }
