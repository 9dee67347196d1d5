// The login form's proof, computed in the browser: HMAC-SHA256 of the namespace's secret over
// "daskflow-kv/login/v1|<namespace>|<nonce>" (plugins/tenants.py login_proof), as hex.
// Inlined by kv_login.html; kvLoginProof is also run by the tests under node.
function kvLoginProof(secret, namespace, nonce) {
  var enc = new TextEncoder();
  return crypto.subtle.importKey('raw', enc.encode(secret), {name: 'HMAC', hash: 'SHA-256'}, false, ['sign'])
    .then(function(key){ return crypto.subtle.sign('HMAC', key, enc.encode('daskflow-kv/login/v1|' + namespace + '|' + nonce)); })
    .then(function(mac){ return Array.from(new Uint8Array(mac), function(b){ return ('0' + b.toString(16)).slice(-2); }).join(''); });
}
(function(){
  if (typeof document === 'undefined') return;
  var form = document.getElementById('login');
  if (!form) return;
  var subtle = window.crypto && window.crypto.subtle && window.isSecureContext;
  var manual = form.querySelector('.manual'), auto = form.querySelector('.auto');
  if (!subtle) return;  // the nonce and the helper command stay shown
  auto.hidden = false; manual.hidden = true;
  var born = Date.now(), ttl = parseFloat(form.getAttribute('data-challenge-ttl')) * 1000;
  function nonce(){  // the page's own challenge while it is fresh, else a new one
    if (Date.now() - born < ttl * 0.75) return Promise.resolve(form.elements.nonce.value);
    return fetch(form.getAttribute('data-challenge'), {method: 'POST', cache: 'no-store'})
      .then(function(r){ if (!r.ok) throw new Error('no challenge (' + r.status + ')'); return r.json(); })
      .then(function(c){ return c.nonce; });
  }
  form.addEventListener('submit', function(ev){
    ev.preventDefault();
    var secret = document.getElementById('secret');
    nonce().then(function(n){
      return kvLoginProof(secret.value, form.elements.namespace.value, n).then(function(proof){
        form.elements.nonce.value = n; form.elements.proof.value = proof; secret.value = '';
        form.submit();
      });
    }).catch(function(e){ alert('login: ' + e.message); });
  });
})();
