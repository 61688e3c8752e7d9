package middleware_test

// The code of "Where Watermill's own middlewares go" in docs/guarantee.md;
// internal/docsnippets checks that the page shows it as it is here.

// snippet:timeout
import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/oncemill/oncemill/middleware"
)

func chainWithTimeout(router *message.Router, poison *middleware.Poison, inbox *middleware.Inbox) {
	router.AddMiddleware(poison.Middleware, wmw.Timeout(10*time.Second), inbox.Middleware)
}

// endsnippet
