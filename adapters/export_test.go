package adapters

// CheckURL is checkURL, for the tests that read URLs without connecting.
func CheckURL(rawURL string, opts Options) error {
	_, _, err := checkURL(rawURL, opts)
	return err
}
