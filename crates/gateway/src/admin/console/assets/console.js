// fleetgate console: live sections and copy buttons. No inline script anywhere (the CSP
// forbids it); everything the pages show is rendered by the server.
'use strict';
(function () {
  var banner = document.getElementById('banner');

  function say(message) {
    if (!banner) { return; }
    banner.textContent = message;
    banner.hidden = false;
  }

  // A section with data-refresh="<url>" is replaced by the server's fragment every
  // data-every milliseconds, without reloading the page.
  function refresh(section) {
    fetch(section.dataset.refresh, { credentials: 'same-origin', cache: 'no-store' })
      .then(function (r) {
        if (r.status === 401) {
          say('Your console session has ended: sign in again with `fleetgate console-login`.');
          return null;
        }
        if (!r.ok) { throw new Error('HTTP ' + r.status); }
        return r.text();
      })
      .then(function (html) {
        if (html === null) { return; }
        section.innerHTML = html;
        section.classList.remove('stale');
        section.dataset.updated = String(Date.now());
      })
      .catch(function () { section.classList.add('stale'); });
  }

  document.querySelectorAll('[data-refresh]').forEach(function (section) {
    var every = parseInt(section.dataset.every || '5000', 10);
    setInterval(function () {
      if (!document.hidden) { refresh(section); }
    }, every);
  });

  // Copy buttons: data-copy names the element whose text is copied.
  document.querySelectorAll('[data-copy]').forEach(function (button) {
    button.addEventListener('click', function () {
      var source = document.getElementById(button.dataset.copy);
      if (!source) { return; }
      var text = source.textContent;
      var done = function () { button.textContent = 'Copied'; };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, function () { select(source); });
      } else {
        select(source);
      }
    });
  });

  // Where the clipboard is not available (plain HTTP to another host), select the text so
  // that Ctrl-C copies it.
  function select(el) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
    say('Press Ctrl-C (⌘-C) to copy the selected text.');
  }
})();
